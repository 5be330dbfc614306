"""``TowerStandIn``: the compiled tower shares the stock tower's tables and attributes, moves its training flag, and
drops what it compiled when its tensors change."""

import torch

from vgraph_compile.hf.stand_in import TowerStandIn


class Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.patch_size = 14


class StandIn(TowerStandIn):
    """Counts its resets (a compiled tower drops its runtimes there)."""

    def __init__(self, tower: torch.nn.Module) -> None:
        super().__init__(tower)
        self.resets = 0

    def _reset(self) -> None:
        self.resets += 1


def test_the_state_dict_and_parameter_names_are_the_towers_own():
    tower = Tower()
    stand_in = StandIn(tower)
    assert list(stand_in.state_dict()) == list(tower.state_dict()) == ["scale", "proj.weight", "proj.bias"]
    assert dict(stand_in.named_parameters()) == dict(tower.named_parameters())
    stand_in.load_state_dict({name: torch.zeros_like(value) for name, value in tower.state_dict().items()})
    assert tower.proj.weight.eq(0).all() and tower.scale.eq(0).all()


def test_attributes_it_lacks_are_read_from_the_tower():
    stand_in = StandIn(Tower())
    assert stand_in.patch_size == 14 and stand_in.proj is stand_in.tower.proj
    assert stand_in.resets == 0  # its own attribute, not the tower's


def test_the_training_flag_moves_the_towers_flag():
    tower = Tower().eval()
    stand_in = StandIn(tower)
    assert not stand_in.training
    stand_in.train()
    assert tower.training and tower.proj.training
    stand_in.eval()
    assert not tower.training


def test_moving_the_tensors_resets_what_was_compiled():
    tower = Tower()
    stand_in = StandIn(tower)
    stand_in.double()
    assert tower.proj.weight.dtype == torch.float64 and stand_in.resets >= 1
