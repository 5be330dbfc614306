"""Saved tower interfaces: a second process serves a packed tower with no probe forward; the tower's own tensors
are never moved, copied or called while its interface is learned; an entry of another config, or a damaged one,
is learned again."""

import json

import pytest
import torch

from tests.helpers import counter_changes
from vgraph_compile.counters import counters
from vgraph_compile.hf import compile_vision_tower
from vgraph_compile.hf.interface.tower_interfaces import interface_key, tower_interface
from vgraph_compile.sample_models.qwen_towers import TOY_SIZES, qwen_tower

OPTIONS = dict(token_budgets=[128, 512], max_items=3, max_frames=6, compiler="eager", attention_backend="sdpa")
GRID = [(1, 8, 12), (2, 4, 4)]
PROBE = 3
"""Probe forwards of a Qwen tower's interface: one recording the metadata, then the stock tower and the tower with
the metadata passed in, on the verification grid."""

SERVE = """
import json, sys, torch
from vgraph_compile.counters import counters
from vgraph_compile.hf import compile_vision_tower
from vgraph_compile.sample_models.qwen_towers import TOY_SIZES, qwen_tower
tower = qwen_tower("qwen2.5-vl", device="cpu", dtype=torch.float32, seed=1, **TOY_SIZES["qwen2.5-vl"])
options = json.loads(sys.argv[2])
grid_thw = torch.tensor(json.loads(sys.argv[3]))
pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), 1176)
with torch.no_grad():
    compiled = compile_vision_tower(tower, artifact_dir=sys.argv[1], **options)
    out = compiled(pixel_values, grid_thw).pooler_output
    from vgraph_compile.hf.attention import routed_attention
    with routed_attention(tower):
        ref = tower(pixel_values, grid_thw).pooler_output
error = ((out - ref).abs().max() / ref.abs().max()).item()
print(json.dumps({"counters": counters.snapshot(), "error": error, "finite": bool(out.isfinite().all())}))
"""


def _tower(seed: int = 0, **resize):
    return qwen_tower("qwen2.5-vl", device="cpu", dtype=torch.float32, seed=seed, **{**TOY_SIZES["qwen2.5-vl"], **resize})


def test_a_second_process_serves_with_zero_probe_forwards(tmp_path, new_process):
    """The first start probes the shrunk tower and saves the interface beside the build plan; a new process (other
    weights) loads both: no probe forward, no trace, and its calls equal its own stock tower."""
    pixel_values = torch.randn(sum(t * h * w for t, h, w in GRID), 1176)
    # nodes rewritten, in both copies: the kernel of the 2 sites and the patch convolution (2 x 3)
    with torch.no_grad(), counters.expect(probe_forwards=PROBE, traces=1, sites_found=2, nodes_rewritten=6,
                                          buckets_built=2, plans_saved=2, replays=2):  # fmt: skip
        compile_vision_tower(_tower(), artifact_dir=str(tmp_path), **OPTIONS)(pixel_values, torch.tensor(GRID))
    child = new_process(SERVE, str(tmp_path), json.dumps(OPTIONS), json.dumps(GRID))
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    moved = {name: value for name, value in result["counters"].items() if value}
    # the interface and the build plan loaded, 2 buckets allocated, the warm-up and the call replayed
    assert moved == dict(interfaces_loaded=1, plans_loaded=1, buckets_built=2, replays=2)
    assert result["finite"] and result["error"] < 1e-5


def test_the_towers_tensors_keep_their_storage_and_the_tower_is_not_called(tmp_path):
    """compile_vision_tower learns the interface on a shrunk tower: every parameter and buffer of the user's tower
    keeps its data pointer and device, and its forward never runs."""
    tower = _tower()
    storage = {name: (value.data_ptr(), value.device) for name, value in tower.state_dict(keep_vars=True).items()}
    calls = []
    hook = tower.register_forward_pre_hook(lambda module, args: calls.append(1))
    with counters.expect(probe_forwards=PROBE):
        compile_vision_tower(tower, artifact_dir=str(tmp_path), **OPTIONS)
    hook.remove()
    assert calls == []
    assert {name: (value.data_ptr(), value.device) for name, value in tower.state_dict(keep_vars=True).items()} == storage


def test_an_interface_of_another_config_is_learned_again(tmp_path):
    """A tower whose config differs (another merger width) has another key: its interface is probed and saved
    beside the first, with its own output width; the first tower's still loads."""
    first, other = _tower(), _tower(out_hidden_size=24)
    assert interface_key(first) != interface_key(other)
    with counters.expect(probe_forwards=PROBE):
        tower_interface(first, tmp_path)
    with counters.expect(probe_forwards=PROBE):
        learned = tower_interface(other, tmp_path)
    assert {field.name: field.width for field in learned.outputs}["pooler_output"] == (24,)
    with counters.expect(interfaces_loaded=1):
        loaded = tower_interface(first, tmp_path)
    assert {field.name: field.width for field in loaded.outputs}["pooler_output"] == (48,)
    assert loaded.metadata.config is first.config
    assert len(list(tmp_path.glob("interface-*.plan"))) == 2


@pytest.mark.parametrize("damage", ["truncate", "other kind"])
def test_a_damaged_interface_is_learned_again(tmp_path, caplog, damage):
    """A truncated entry fails its hash; an entry holding something else is not an interface: each is logged,
    removed, probed again and saved again, and the next start loads it."""
    import pickle

    tower = _tower()
    tower_interface(tower, tmp_path)
    (entry,) = tmp_path.glob("interface-*.plan")
    if damage == "truncate":
        entry.write_bytes(entry.read_bytes()[:100])
    else:
        from vgraph_compile.compile import artifacts

        artifacts.save_plan(tmp_path, interface_key(tower), {"not": "an interface"})
        assert pickle.loads(entry.read_bytes()) == {"not": "an interface"}
    with counters.expect(probe_forwards=PROBE):
        tower_interface(tower, tmp_path)
    assert "building it again" in caplog.text
    with counters.expect(interfaces_loaded=1):
        tower_interface(tower, tmp_path)


def test_a_refusal_is_saved_and_raised_again_without_a_probe(tmp_path):
    """A tower the interface refuses (MiniMax-M3-VL: its output has no fixed number of rows per patch) is probed
    once: the refusal is saved under its key, and a later start raises it again with no probe forward."""
    from vgraph_compile.hf.interface.metadata_plan import TowerRefused
    from vgraph_compile.sample_models.vision_utils_towers import build_tower

    tower = build_tower("minimax_m3_vl", tiny=True)
    with counter_changes() as probed, pytest.raises(TowerRefused, match="no fixed number of rows") as first:
        tower_interface(tower, tmp_path)
    assert probed["probe_forwards"] > 0
    with counters.expect(interfaces_loaded=1), pytest.raises(TowerRefused) as again:
        tower_interface(tower, tmp_path)
    assert str(again.value) == str(first.value)


def test_a_refusal_the_machine_caused_is_not_saved(tmp_path, monkeypatch):
    """A probe that runs out of memory on every row layout refuses the tower, but the refusal is not saved: the
    next start probes again (and, with memory, learns the interface)."""
    from vgraph_compile.hf.interface import packed_tower
    from vgraph_compile.hf.interface.metadata_plan import TowerRefused

    tower = qwen_tower("qwen2-vl", "cpu", torch.float32, **TOY_SIZES["qwen2-vl"])

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("probe out of memory")

    with monkeypatch.context() as patched:
        patched.setattr(packed_tower, "record_metadata", out_of_memory)
        with pytest.raises(TowerRefused, match="OutOfMemoryError: probe out of memory"):
            tower_interface(tower, tmp_path)
    with counter_changes() as probed:
        tower_interface(tower, tmp_path)
    assert (probed["probe_forwards"], probed["interfaces_loaded"]) == (PROBE, 0)
