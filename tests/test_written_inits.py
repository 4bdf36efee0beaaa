"""The per-step dataclasses whose ``__init__`` is written out (mypyc compiles a written one, not the one
``dataclasses`` generates) take exactly the fields, order and defaults they declare, and ``StepShape.as_dict``
is ``dataclasses.asdict`` without the copy: a field added later to the declaration but not to ``__init__``
fails here."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from engines.core.kv_cache_manager import KVStats
from engines.core.llm_engine import StepRecord
from engines.core.scheduler import ScheduledSeq, SchedulerOutput, StepResult
from engines.core.step_shape import StepShape


@pytest.mark.parametrize("cls", [ScheduledSeq, SchedulerOutput, StepResult, KVStats, StepRecord, StepShape])
def test_written_init_takes_the_declared_fields_and_defaults(cls):
    fields = [f for f in dataclasses.fields(cls) if f.init]
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields]
    for f, p in zip(fields, params):
        if f.default is not dataclasses.MISSING:
            assert p.default == f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert p.default is None, f.name  # None stands for a fresh default_factory() value
        else:
            assert p.default is inspect.Parameter.empty, f.name
    required = [0 if p.annotation.startswith("int") else [] for p in params if p.default is inspect.Parameter.empty]
    a, b = cls(*required), cls(*required)
    for f in fields:
        if f.default_factory is not dataclasses.MISSING:
            assert getattr(a, f.name) == f.default_factory()
            assert getattr(a, f.name) is not getattr(b, f.name), f"{f.name}: one object shared by two instances"
        elif f.default is not dataclasses.MISSING:
            assert getattr(a, f.name) == f.default
    assert a == b


def test_step_shape_as_dict_is_asdict():
    s = StepShape(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0.5)
    assert s.as_dict() == dataclasses.asdict(s)
    assert list(s.as_dict()) == [f.name for f in dataclasses.fields(StepShape)]
