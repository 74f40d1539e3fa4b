"""Backend-independent protocol: what a trajectory is and how it is born, stored, scored and cleared.

The names below are the package's stable surface, e.g. ``from protocol import DataProto, KVBatchMeta, LocalStore``.
``TransferQueueStore`` is resolved lazily, so ``import protocol`` never imports Ray.
"""
from __future__ import annotations

from typing import Any

from protocol.batch.dataproto import (
    DataProto, DataProtoConfig, DataProtoItem, collate_fn, deserialize_single_tensor, deserialize_tensordict,
    fold_batch_dim, list_of_dict_to_dict_of_list, pad_dataproto_to_divisor, serialize_single_tensor,
    serialize_tensordict, unfold_batch_dim, union_numpy_dict, union_tensor_dict, unpad_dataproto,
)
from protocol.store.keys import (
    PromptStatus, group_of, new_uid, parse_trajectory_key, prompt_tag, trajectory_key, trajectory_tag, transition,
)
from protocol.store.meta import KVBatchMeta
from protocol.batch.nested import (
    PackedBatch, jagged_to_padded, nested_lengths, nested_offsets, nested_values, pack_nested, packed_to_padded,
    padded_to_jagged, padded_to_packed, response_from_nested, response_to_nested, response_values_from_packed,
    response_values_to_packed, to_nested, unpack_to_nested,
)
from protocol.store import (
    FieldOverwriteError, FieldShapeError, KVStore, LateWriteError, LocalStore, StoreClosedError, StoreKeyError,
)

__all__ = [
    # batches
    "DataProto", "DataProtoConfig", "DataProtoItem", "collate_fn", "pad_dataproto_to_divisor", "unpad_dataproto",
    "union_tensor_dict", "union_numpy_dict", "list_of_dict_to_dict_of_list", "fold_batch_dim", "unfold_batch_dim",
    "serialize_single_tensor", "deserialize_single_tensor", "serialize_tensordict", "deserialize_tensordict",
    # nested <-> padded
    "to_nested", "nested_lengths", "nested_offsets", "nested_values", "jagged_to_padded", "padded_to_jagged",
    "response_to_nested", "response_from_nested",
    "PackedBatch", "pack_nested", "unpack_to_nested", "padded_to_packed", "packed_to_padded",
    "response_values_from_packed", "response_values_to_packed",
    # store
    "KVBatchMeta", "KVStore", "LocalStore", "TransferQueueStore", "StoreKeyError", "FieldOverwriteError",
    "LateWriteError", "FieldShapeError", "StoreClosedError",
    # keys and states
    "PromptStatus", "new_uid", "trajectory_key", "parse_trajectory_key", "group_of", "transition", "prompt_tag",
    "trajectory_tag",
]


def __getattr__(name: str) -> Any:
    if name == "TransferQueueStore":
        from protocol.store.tq import TransferQueueStore

        return TransferQueueStore
    raise AttributeError(f"module 'protocol' has no attribute {name!r}")
