"""Every served packed family, over its configuration space (``family_configs.tower_sizes``): a drawn tower is
compiled once, served by bucket graphs on one image, several images and a video, and a split call, and equal to
the stock tower in fp32. The default profile draws one fixed config per family; ``HYPOTHESIS_PROFILE=thorough``
draws many (a failure prints the drawn config)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hf.family_configs import check_served, tower_sizes
from tests.hf.test_families import REFUSED
from vgraph_compile.models.hf_families import vision_utils_families

SERVED = sorted(set(vision_utils_families()) - set(REFUSED))
THOROUGH = settings.get_current_profile_name() == "thorough"


@pytest.mark.parametrize("name", SERVED)
@settings(
    max_examples=40 if THOROUGH else 1,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_drawn_tower_served_equal_to_stock(name, data):
    check_served(name, data.draw(tower_sizes(name), label="config"))
