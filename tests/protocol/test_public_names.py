"""The package roots export their stable names, and importing protocol never starts Ray."""
import subprocess
import sys


def test_protocol_root_exports():
    import protocol

    for name in protocol.__all__:
        assert getattr(protocol, name) is not None, name
    from protocol import DataProto, KVBatchMeta, LocalStore, TransferQueueStore  # noqa: F401


def test_import_protocol_does_not_import_ray():
    code = "import sys, protocol, dispatch; print('ray' in sys.modules, 'transfer_queue' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False False"


def test_dispatch_root_exports():
    import dispatch

    for name in ("Topology", "balance_partitions", "DispatchPlan", "build_plan", "make_padding"):
        assert name in dispatch.__all__ and getattr(dispatch, name) is not None


# Names shared with the reference system (verl) and its signatures: parameter names in order, with their defaults
# (``REQUIRED`` = no default). A shared name must keep this signature; a different function needs a different name.
REQUIRED = object()
VERL_SIGNATURES = {
    "protocol.batch.dataproto": {
        "pad_dataproto_to_divisor": [("data", REQUIRED), ("size_divisor", REQUIRED)],
        "unpad_dataproto": [("data", REQUIRED), ("pad_size", REQUIRED)],
        "union_tensor_dict": [("tensor_dict1", REQUIRED), ("tensor_dict2", REQUIRED)],
        "union_numpy_dict": [("tensor_dict1", REQUIRED), ("tensor_dict2", REQUIRED)],
        "list_of_dict_to_dict_of_list": [("list_of_dict", REQUIRED)],
        "fold_batch_dim": [("data", REQUIRED), ("new_batch_size", REQUIRED)],
        "unfold_batch_dim": [("data", REQUIRED), ("batch_dims", 2)],
        "serialize_single_tensor": [("obj", REQUIRED)],
        "deserialize_single_tensor": [("arr", REQUIRED)],
        "serialize_tensordict": [("batch", REQUIRED)],
        "deserialize_tensordict": [("arr", REQUIRED)],
        "collate_fn": [("x", REQUIRED)],
    },
    "protocol.batch.nested": {
        "response_from_nested": [("tensor", REQUIRED), ("response_mask", REQUIRED)],
        "response_to_nested": [("tensor", REQUIRED), ("response_mask", REQUIRED)],
    },
}
VERL_DATAPROTO_METHODS = {
    "from_single_dict": [("data", REQUIRED), ("meta_info", None), ("auto_padding", False)],
    "from_dict": [("tensors", None), ("non_tensors", None), ("meta_info", None), ("num_batch_dims", 1),
                  ("auto_padding", False)],
    "from_tensordict": [("tensor_dict", None), ("meta_info", None), ("num_batch_dims", 1)],
    "to": [("self", REQUIRED), ("device", REQUIRED)],
    "select": [("self", REQUIRED), ("batch_keys", None), ("non_tensor_batch_keys", None), ("meta_info_keys", None),
               ("deepcopy", False)],
    "select_idxs": [("self", REQUIRED), ("idxs", REQUIRED)],
    "slice": [("self", REQUIRED), ("start", None), ("end", None), ("step", None)],
    "pop": [("self", REQUIRED), ("batch_keys", None), ("non_tensor_batch_keys", None), ("meta_info_keys", None)],
    "rename": [("self", REQUIRED), ("old_keys", None), ("new_keys", None)],
    "union": [("self", REQUIRED), ("other", REQUIRED)],
    "make_iterator": [("self", REQUIRED), ("mini_batch_size", REQUIRED), ("epochs", REQUIRED), ("seed", None),
                      ("dataloader_kwargs", None)],
    "is_padding_enabled": [("self", REQUIRED)],
    "padding": [("self", REQUIRED), ("padding_size", REQUIRED), ("padding_candidate", "")],
    "chunk": [("self", REQUIRED), ("chunks", REQUIRED)],
    "split": [("self", REQUIRED), ("split_size", REQUIRED)],
    "concat": [("data", REQUIRED)],
    "reorder": [("self", REQUIRED), ("indices", REQUIRED)],
    "repeat": [("self", REQUIRED), ("repeat_times", 2), ("interleave", True)],
    "unfold_column_chunks": [("self", REQUIRED), ("n_split", REQUIRED), ("split_keys", None)],
    "sample_level_repeat": [("self", REQUIRED), ("repeat_times", REQUIRED)],
    "to_tensordict": [("self", REQUIRED)],
    "save_to_disk": [("self", REQUIRED), ("filepath", REQUIRED)],
    "load_from_disk": [("filepath", REQUIRED)],
    "check_consistency": [("self", REQUIRED)],
}


def _params(fn):
    import inspect

    return [(p.name, REQUIRED if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(fn).parameters.values()]


def test_names_shared_with_verl_keep_its_signatures():
    import importlib

    from protocol.batch.dataproto import DataProto, DataProtoConfig

    for module_name, functions in VERL_SIGNATURES.items():
        module = importlib.import_module(module_name)
        for name, expected in functions.items():
            assert name in module.__all__, (module_name, name)
            assert _params(getattr(module, name)) == expected, (module_name, name)
    for name, expected in VERL_DATAPROTO_METHODS.items():
        assert _params(getattr(DataProto, name)) == expected, name
    assert DataProtoConfig.auto_padding_key == "_verl_auto_padding" and isinstance(DataProtoConfig.auto_padding, bool)


def test_our_jagged_padded_helpers_have_names_of_their_own():
    """The jagged <-> padded conversions that once used the reference's response_*_nested names are renamed."""
    import protocol
    from protocol.batch import nested

    assert _params(nested.jagged_to_padded) == [("nt", REQUIRED), ("pad_value", 0), ("max_len", None)]
    assert _params(nested.padded_to_jagged) == [("padded", REQUIRED), ("lengths", REQUIRED)]
    for name in ("jagged_to_padded", "padded_to_jagged", "response_from_nested", "response_to_nested"):
        assert getattr(protocol, name) is getattr(nested, name)
