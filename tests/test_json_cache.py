"""``json_cache``: files merged across writers, replaced whole, read as empty when broken."""

from vgraph_compile import json_cache


def test_a_file_merges_writers_and_is_replaced_whole(tmp_path):
    """Two processes' entries both survive; no temporary file is left; a corrupt file reads as empty."""
    path = str(tmp_path / "cache" / "vgraph_kernels.json")
    assert json_cache.load(path) == {}
    json_cache.merge(path, {"rank 0 shape": {"cudnn": 1.0}})
    json_cache.merge(path, {"rank 1 shape": {"torch_varlen": 2.0}})
    assert json_cache.load(path) == {"rank 0 shape": {"cudnn": 1.0}, "rank 1 shape": {"torch_varlen": 2.0}}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["vgraph_kernels.json"]
    (tmp_path / "cache" / "vgraph_kernels.json").write_text("{half")
    assert json_cache.load(path) == {}
