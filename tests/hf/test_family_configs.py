"""Every served packed family over its configuration space (``family_configs.tower_sizes``): a drawn tower is
compiled once, served by bucket graphs on one image, several images and a video, and a split call, and equal to
the stock tower in fp32. A failure prints the family and the drawn config.

The default profile runs the explicit examples (the layouts that broke the shared mechanism: every block a window
block, every block full attention, an empty deepstack list) and one drawn config; ``HYPOTHESIS_PROFILE=thorough``
draws many configs per family (``scripts/family_config_sweep.py`` records every outcome of such a draw)."""

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.hf.family_configs import check_served, tiny_sizes, tower_sizes
from tests.helpers import THOROUGH
from tests.hf import test_block_graphs
from tests.hf.test_families import REFUSED
from vgraph_compile.sample_models.vision_utils_towers import vision_utils_families

SERVED = sorted(
    set(vision_utils_families()) - set(REFUSED) - set(test_block_graphs.SERVED) - set(test_block_graphs.REFUSED)
)
"""The families served by the whole-tower graph; the block-graph tier's are tested on one tiny config each in
``test_block_graphs`` (drawing their configs is not built: ``check_served`` reads the whole-tower encoder)."""
_SETTINGS = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@settings(max_examples=1, **_SETTINGS)
@given(name=st.sampled_from(SERVED), data=st.data())
@example(name="qwen2_5_vl", data=None).via("every block a window block: attention routed, windows bounded")
@example(name="exaone4_5", data=None).via("every block full attention")
@example(name="qwen3_vl", data=None).via("an empty deepstack list")
def test_served_configs(name, data):
    """One drawn family and config; the explicit examples name the layouts that once failed."""
    if data is None:
        fields = {
            "qwen2_5_vl": dict(depth=2, fullatt_block_indexes=[7, 15, 23, 31]),
            "exaone4_5": dict(depth=2, fullatt_block_indexes=[0, 1]),
            "qwen3_vl": dict(depth=2, deepstack_visual_indexes=[]),
        }[name]
        return check_served(name, tiny_sizes(name, **fields))
    check_served(name, data.draw(tower_sizes(name), label="config"))


@pytest.mark.skipif(not THOROUGH, reason="many configs per family: HYPOTHESIS_PROFILE=thorough")
@pytest.mark.parametrize("name", SERVED)
@settings(max_examples=40, **_SETTINGS)
@given(data=st.data())
def test_drawn_tower_served_equal_to_stock(name, data):
    check_served(name, data.draw(tower_sizes(name), label="config"))
