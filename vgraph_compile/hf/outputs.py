"""A tower's output object, built per call without transformers' per-call dataclass introspection.

A transformers ``ModelOutput`` is a dataclass and an ordered dict: its ``__init__``/``__post_init__``/
``__setattr__`` read ``dataclasses.fields`` on every field set. ``OutputFactory`` reads the fields once per
class and sets what ``__post_init__`` sets directly: every field as an attribute, the ones not None also as dict
items, in field order. Invariant: the object equals ``output_class(**fields)`` (its class, items, attributes):
checked on the factory's first call against a normal construction, and the factory constructs normally ever
after where they differ (another transformers version, or a class that is not a ``ModelOutput``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

__all__ = ["OutputFactory"]

log = logging.getLogger(__name__)


class OutputFactory:
    """``factory(fields)``: ``output_class(**fields)``, directly where that builds the same object."""

    def __init__(self, output_class: type) -> None:
        self.output_class = output_class
        self._names: tuple[str, ...] | None = None
        """The dataclass fields, once the direct build matched a normal one; None before (or never)."""
        self._checked = False

    def _direct(self, fields: dict[str, Any]) -> Any:
        output = self.output_class.__new__(self.output_class)
        for name in self._names:
            value = fields.get(name)
            if value is not None:
                collections.OrderedDict.__setitem__(output, name, value)
            object.__setattr__(output, name, value)
        return output

    def __call__(self, fields: dict[str, Any]) -> Any:
        if self._names is not None:
            return self._direct(fields)
        output = self.output_class(**fields)
        if not self._checked:
            self._checked = True
            if dataclasses.is_dataclass(output) and isinstance(output, collections.OrderedDict):
                self._names = tuple(field.name for field in dataclasses.fields(output))
                if not _same(self._direct(fields), output):
                    log.info("%s: built by its own __init__ per call", self.output_class.__name__)
                    self._names = None
        return output


def _same(direct: Any, expected: Any) -> bool:
    return (
        type(direct) is type(expected)
        and [(key, id(value)) for key, value in direct.items()] == [(key, id(value)) for key, value in expected.items()]
        and vars(direct).keys() == vars(expected).keys()
        and all(vars(direct)[name] is value for name, value in vars(expected).items())
    )
