"""What ``learn_packed_tower`` derives beyond the metadata plan, on tiny towers of families whose forward needs it:
a grid read outside ``vision_utils`` (traced as a padded table), pixel rows with a leading batch dim of 1, and
calls bound to the tower's own argument names. Served equal to eager by graph replays: ``test_families.py``."""

import pytest
import torch

from vgraph_compile.hf import compile_vision_tower
from vgraph_compile.hf.interface.grid_metadata import GridMetadata
from vgraph_compile.hf.interface.packed_tower import grid_table, learn_packed_tower
from vgraph_compile.sample_models.vision_utils_towers import build_tower


def test_grid_table_pads_with_one_merge_unit_images():
    table = grid_table(torch.tensor([(1, 4, 6), (2, 2, 2)]), 4, merge=2)
    assert table.tolist() == [[1, 4, 6], [2, 2, 2], [1, 2, 2], [1, 2, 2]]


def test_a_grid_read_outside_vision_utils_is_passed_as_a_table_of_fixed_rows():
    """GLM-Image's embeddings index ``grid_thw[segment, 1]`` per patch: withholding the grid fails, a padded table
    gives exactly the stock outputs, so the cached metadata carries the table, one row count for every grid."""
    tower = build_tower("glm_image", tiny=True)
    interface = learn_packed_tower(tower)
    assert interface.grid_traced and not interface.batched
    metadata = GridMetadata(tower, interface, grid_rows=5)
    for grid in (((1, 2, 4),), ((1, 2, 2), (1, 4, 4), (1, 1, 1))):
        table = metadata(grid, "cpu")["grid_thw"]
        assert table.tolist() == [list(row) for row in grid] + [[1, 1, 1]] * (5 - len(grid))


def test_batched_pixel_rows_are_derived_and_checked_in_the_towers_names():
    """PaddleOCR-VL takes ``pixel_values[1, patches, C, P, P]`` by keyword; rows without the leading dim, or a call
    its forward cannot bind, are a ValueError before anything is traced."""
    tower = build_tower("paddleocr_vl", tiny=True)
    served = compile_vision_tower(tower, token_budgets=[256], compiler="eager", attention_backend="sdpa")
    assert served.interface.batched and served.interface.pixel_shape == (3, 14, 14)
    assert served.interface.pixel_values_shape(8) == (1, 8, 3, 14, 14)
    grid_thw = torch.tensor([(1, 2, 4)])
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"pixel_values must be \[1, patches, 3, 14, 14\]"):
            served(pixel_values=torch.randn(8, 3, 14, 14), grid_thw=grid_thw)
        with pytest.raises(ValueError, match=r"PaddleOCRVisionModel.forward\(pixel_values"):
            served(grid_thw=grid_thw)
    assert not served.runtimes


def test_probes_on_two_threads_restore_the_thread_count_they_found():
    """Probes overlapping on two threads (the second starts inside the first and ends after it): at most
    ``PROBE_THREADS`` intra-op threads while either runs, and the process's own count back after both."""
    import threading

    from vgraph_compile.hf.interface import packed_tower

    before = torch.get_num_threads()
    torch.set_num_threads(packed_tower.PROBE_THREADS + 1)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    inside = []

    def first():
        with packed_tower._probe_threads():
            first_in.set()
            second_in.wait()
        first_out.set()

    def second():
        first_in.wait()
        with packed_tower._probe_threads():
            second_in.set()
            first_out.wait()
            inside.append(torch.get_num_threads())

    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert inside == [packed_tower.PROBE_THREADS]
        assert torch.get_num_threads() == packed_tower.PROBE_THREADS + 1
    finally:
        torch.set_num_threads(before)
