"""Topology: DP formulas, rank maps (vs megatron-core's RankGenerator and torch's DeviceMesh), validation."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from dispatch import Backend, Topology, TopologyError

pow2 = st.sampled_from([1, 2, 4])


def _rank_generator():
    from megatron.core.parallel_state import RankGenerator

    return RankGenerator


def _coords_from_groups(groups: list[list[int]], world: int) -> list[int]:
    """Position of each rank inside the (ordered) megatron-core group that holds it."""
    pos = [-1] * world
    for g in groups:
        for i, r in enumerate(g):
            pos[r] = i
    return pos


@settings(max_examples=40, deadline=None)
@given(tp=pow2, pp=pow2, cp=pow2, dp=st.sampled_from([1, 2, 3, 4]), ep=pow2, etp=pow2)
def test_megatron_rank_map_matches_rank_generator(tp, pp, cp, dp, ep, etp):
    world = tp * pp * cp * dp
    cfg = {"backend": "megatron", "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp}
    if world % (etp * ep * pp):
        with pytest.raises(TopologyError, match="etp\\*ep\\*pp"):
            Topology.from_config(cfg, world)
        return
    topo = Topology.from_config(cfg, world)
    assert topo.dp_size == world // (tp * pp * cp) == dp
    RG = _rank_generator()
    dec = RG(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    exp = RG(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    want = {name: _coords_from_groups(dec.get_ranks(name), world) for name in ("tp", "pp", "cp", "dp")}
    want["ep"] = _coords_from_groups(exp.get_ranks("ep"), world)
    want["etp"] = _coords_from_groups(exp.get_ranks("tp"), world)
    want["edp"] = _coords_from_groups(exp.get_ranks("dp"), world)
    for r in range(world):
        c = topo.coords(r)
        assert {k: c[k] for k in want} == {k: v[r] for k, v in want.items()}, r
    # ranks_of_dp agrees with the complement of megatron-core's dp groups
    for d in range(topo.dp_size):
        assert topo.ranks_of_dp(d) == sorted(r for r in range(world) if want["dp"][r] == d)
    # exactly one reporting rank per replica: tp 0, last pp stage, cp 0
    for d in range(topo.dp_size):
        rep = [r for r in topo.ranks_of_dp(d) if topo.is_reporting(r)]
        assert rep == [topo.reporting_rank(d)]
        c = topo.coords(rep[0])
        assert (c["tp"], c["pp"], c["cp"]) == (0, pp - 1, 0)


@settings(max_examples=40, deadline=None)
@given(sp=st.sampled_from([1, 2, 4, 8]), rest=st.integers(1, 6), fsdp=st.sampled_from([-1, 1, 2, 4, 8]))
def test_fsdp_dp_formula_and_mesh_layout(sp, rest, fsdp):
    world = sp * rest
    cfg = {"backend": "fsdp", "ulysses_sp": sp, "fsdp_size": fsdp}
    if fsdp != -1 and world % fsdp:
        with pytest.raises(TopologyError, match="fsdp_size"):
            Topology.from_config(cfg, world)
        return
    topo = Topology.from_config(cfg, world)
    assert topo.dp_size == world // sp  # fsdp_size never changes DP
    shard = world if fsdp == -1 else fsdp
    for r in range(world):
        c = topo.coords(r)
        # row-major meshes, as init_device_mesh lays them out
        assert (c["dp"], c["sp"]) == divmod(r, sp)
        assert (c["replicate"], c["shard"]) == divmod(r, shard)
        assert c["tp"] == c["pp"] == c["cp"] == c["ep"] == 0
        assert topo.is_reporting(r) == (c["sp"] == 0)
    assert sorted(r for d in range(topo.dp_size) for r in topo.ranks_of_dp(d)) == list(range(world))


def test_rank_maps_match_device_mesh_and_megatron_parallel_state(torchrun):
    # one launch: DeviceMesh and megatron-core parallel state on a 4-rank gloo world, and every rank planning alone
    out = torchrun("dispatch_topology_worker.py", 4)
    ok = [line for line in out.splitlines() if line.startswith("OK ")]
    assert len(ok) >= 15, out
    assert sum("plan identical on all ranks" in line for line in ok) == 3
    assert any("megatron {'tp': 2, 'pp': 2" in line for line in ok)
    assert any("ulysses_sp=2" in line for line in ok) and any("fsdp_size=2" in line for line in ok)


def test_dynamic_cp_gives_one_logical_replica():
    topo = Topology.from_config({"backend": "megatron", "tp": 2, "cp": 2, "dynamic_cp": True}, 8)
    assert topo.dp_size == 1 and topo.megatron_dp == 2
    assert all(topo.dp_rank(r) == 0 for r in range(8))
    assert [r for r in range(8) if topo.is_reporting(r)] == [0]
    assert topo.seq_shards == 4  # dp x cp ranks share sequences


def test_rollout_tp_never_enters_dp():
    a = Topology.from_config({"backend": "fsdp", "rollout_tp": 4}, 8)
    b = Topology.from_config({"backend": "fsdp"}, 8)
    assert a.dp_size == b.dp_size == 8 and a.rollout_tp == 4
    with pytest.raises(TopologyError, match="rollout_tp \\(3\\)"):
        Topology.from_config({"backend": "fsdp", "rollout_tp": 3}, 8)


@pytest.mark.parametrize("cfg, world, needle", [
    ({"backend": "megatron", "tp": 3}, 8, "tp\\*pp\\*cp = 3\\*1\\*1 = 3"),
    ({"backend": "megatron", "vpp": 2}, 8, "vpp=2 .* needs pp > 1"),
    ({"backend": "megatron", "ep": 4}, 6, "etp\\*ep\\*pp"),
    ({"backend": "megatron", "ep": 2, "num_experts": 3}, 8, "num_experts \\(3\\) is not divisible by ep \\(2\\)"),
    ({"backend": "fsdp", "ulysses_sp": 3}, 8, "ulysses_sp \\(3\\)"),
    ({"backend": "fsdp", "fsdp_size": 3}, 8, "fsdp_size \\(3\\)"),
    ({"backend": "fsdp", "fsdp_size": 0}, 8, "fsdp_size"),
    ({"backend": "fsdp", "tp": 2}, 8, "backend 'fsdp' has no tp=2"),
    ({"backend": "megatron", "ulysses_sp": 2}, 8, "backend 'megatron' has no ulysses_sp"),
    ({"backend": "tpu"}, 8, "backend must be one of"),
    ({"backend": "fsdp", "bogus": 1}, 8, "unknown topology keys \\['bogus'\\]"),
    ({"backend": "fsdp"}, 0, "world_size must be a positive int"),
    ({"backend": "megatron", "tp": 0}, 8, "tp must be a positive int"),
    ({"tp": 2}, 8, "needs a backend"),
])
def test_invalid_combinations_are_refused_with_the_numbers(cfg, world, needle):
    with pytest.raises(TopologyError, match=needle):
        Topology.from_config(cfg, world)


def test_from_typed_sections_and_aliases():
    from backends.config import FSDPConfig, MegatronConfig

    m = Topology.from_config(MegatronConfig(tp=2, pp=2, vpp=2), 8, backend="megatron")
    assert (m.backend, m.tp, m.pp, m.vpp, m.dp_size, m.microbatch_group) == (Backend.MEGATRON, 2, 2, 2, 2, 2)
    f = Topology.from_config({"backend": "fsdp", **dataclasses.asdict(FSDPConfig(ulysses_sp=2, fsdp_size=4))}, 8)
    assert (f.dp_size, f.shard_size, f.replicate_size, f.seq_shards) == (4, 4, 2, 2)
    g = Topology.from_config(FSDPConfig(ulysses_sp=2), 8, backend="fsdp")
    assert g == Topology(backend="fsdp", world_size=8, ulysses_sp=2)
    a = Topology.from_config({"backend": "megatron", "tensor_model_parallel_size": 2,
                              "virtual_pipeline_model_parallel_size": None}, 4)
    assert a.tp == 2 and a.vpp == 1
    with pytest.raises(TopologyError, match="disagrees"):
        Topology.from_config({"backend": "fsdp"}, 4, backend="megatron")


def test_coords_bounds_table_and_summary():
    topo = Topology.from_config({"backend": "megatron", "tp": 2, "pp": 2}, 8)
    with pytest.raises(TopologyError, match="global rank"):
        topo.coords(8)
    with pytest.raises(TopologyError, match="dp_rank"):
        topo.ranks_of_dp(2)
    table = topo.table()
    assert table.splitlines()[0].split()[:4] == ["rank", "dp", "tp", "pp"]
    assert len(table.splitlines()) == 9 and table.count("yes") == 2
    assert "... (6 more ranks)" in topo.table(max_rows=2)
    assert "-> dp=2" in topo.summary()
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.tp = 4  # type: ignore[misc]


@settings(max_examples=25, deadline=None)
@given(sp=st.sampled_from([1, 2, 4]), rest=st.sampled_from([1, 2, 3, 4, 8]), fsdp=st.sampled_from([-1, 1, 2, 4]),
       data=st.data())
def test_fsdp_rank_map_matches_device_mesh_on_fake_world(sp, rest, fsdp, data):
    # torch's fake process group lets one process build the DeviceMesh any rank of a large world would see
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = sp * rest
    if fsdp != -1 and world % fsdp:
        return
    topo = Topology.from_config({"backend": "fsdp", "ulysses_sp": sp, "fsdp_size": fsdp}, world)
    rank = data.draw(st.integers(0, world - 1))
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        c = topo.coords(rank)
        mesh = init_device_mesh("cpu", (world // sp, sp), mesh_dim_names=("dp", "sp"))
        assert (c["dp"], c["sp"]) == tuple(mesh.get_coordinate())
        assert c["dp"] == mesh["dp"].get_local_rank() and topo.dp_size == mesh["dp"].size()
        shard = world if fsdp == -1 else fsdp
        hsdp = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        assert (c["replicate"], c["shard"]) == tuple(hsdp.get_coordinate())
    finally:
        dist.destroy_process_group()


@settings(max_examples=40, deadline=None)
@given(tp=pow2, pp=pow2, cp=pow2, dp=st.sampled_from([1, 2, 3]), dynamic_cp=st.booleans(),
       sp=st.sampled_from([1, 2, 4]), fsdp=st.sampled_from([-1, 1, 2]))
def test_mapping_and_typed_section_build_the_same_topology(tp, pp, cp, dp, dynamic_cp, sp, fsdp):
    from backends.config import FSDPConfig, MegatronConfig
    from dispatch import FSDPParallel, MegatronParallel, parallel_section

    world = tp * pp * cp * dp
    mg = {"tp": tp, "pp": pp, "cp": cp, "dynamic_cp": dynamic_cp}
    section, job = parallel_section({"backend": "megatron", **mg})
    assert section == MegatronParallel(**mg) and job == {}
    typed = Topology.from_config(MegatronParallel(**mg), world)
    assert typed == Topology.from_config({"backend": "megatron", **mg}, world) \
        == Topology.from_config(MegatronConfig(**mg, sequence_parallel=True), world)
    assert typed == Topology(backend="megatron", world_size=world, **mg)
    world = sp * dp * 2
    if fsdp != -1 and world % fsdp:
        return
    fs = {"ulysses_sp": sp, "fsdp_size": fsdp}
    typed = Topology.from_config(FSDPParallel(**fs), world, rollout_tp=2)
    assert typed == Topology.from_config({"backend": "fsdp", "rollout_tp": 2, **fs}, world) \
        == Topology.from_config(FSDPConfig(**fs, param_dtype="bf16"), world, backend="fsdp", rollout_tp=2)
    assert typed.rollout_tp == 2 and typed.backend is Backend.FSDP


def test_typed_path_refusals_name_what_to_change():
    from backends.config import FSDPConfig, MegatronConfig
    from dispatch import FSDPParallel, MegatronParallel
    from protocol.config import ConfigError

    assert issubclass(FSDPConfig, FSDPParallel) and issubclass(MegatronConfig, MegatronParallel)
    assert FSDPConfig.backend is Backend.FSDP and MegatronConfig.backend is Backend.MEGATRON
    with pytest.raises(TopologyError, match="disagrees with the MegatronConfig section"):
        Topology.from_config(MegatronConfig(), 4, backend="fsdp")
    with pytest.raises(TopologyError, match="takes an FSDPParallel or MegatronParallel section .* got SimpleNamespace"):
        import types

        Topology.from_config(types.SimpleNamespace(tp=2, backend="megatron"), 4)
    with pytest.raises(TopologyError, match="rollout_tp=4 disagrees with the config's rollout_tp=2"):
        Topology.from_config({"backend": "fsdp", "rollout_tp": 2}, 8, rollout_tp=4)
    with pytest.raises(TopologyError, match="tp must be a positive int, got int 0"):
        MegatronParallel(tp=0)  # a section refuses bad degrees when built, before any world size is known
    with pytest.raises(TopologyError, match="fsdp_size must be -1"):
        FSDPConfig(fsdp_size=0)
    # the other backend's degrees at their defaults carry no setting and are accepted
    assert Topology.from_config({"backend": "fsdp", "tp": 1, "vpp": None}, 2).dp_size == 2
    assert issubclass(TopologyError, ConfigError)
