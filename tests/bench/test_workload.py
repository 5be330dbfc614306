from vgraph_compile.bench.workload import CASES_PX, random_requests, to_grid


def test_random_requests_are_seeded_and_within_the_stated_ranges():
    requests = random_requests(seed=0, count=64)
    assert requests == random_requests(seed=0, count=64) and requests != random_requests(seed=1, count=64)
    for items in requests:
        images = [item for item in items if item[0] == 1]
        assert 1 <= len(images) <= 4
        for _, h, w in images:
            assert 224 <= min(h, w) and max(h, w) <= 1344 and max(h, w) / min(h, w) <= 2.0 + 1e-9
    assert any(item[0] > 1 for items in requests for item in items), "some requests carry a video"


def test_to_grid_rounds_to_whole_merged_tokens():
    assert to_grid(CASES_PX["1x224^2"], 14, 2, 2) == [(1, 16, 16)]
    assert to_grid(CASES_PX["video 16f 336^2"], 14, 2, 2) == [(8, 24, 24)]
    assert to_grid([(1, 336, 336)], 16, 2, 2) == [(1, 20, 20)]  # 336 / 32 = 10.5 rounds half to even, as the processor
