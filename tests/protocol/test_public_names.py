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
