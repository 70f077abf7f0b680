"""Every option is declared once, as a dataclass field carrying its check; the validators, the constructors'
signatures (LightningCLI reads them) and the shared options are derived from the fields. These tests fail when an
option is declared in one place only: a field without a check, a constructor that does not expose a field, a field
the docs do not mention, or an option declared separately in two configs."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from lightning_streamkl import (
    AttentionKLOptions,
    ContinualAttentionRegularizer,
    ContinualConfig,
    LayerPair,
    StreamKLConfig,
    StreamKLDistillation,
    validate_config,
)
from lightning_streamkl.capture import CAPTURE_KINDS
from lightning_streamkl.continual import validate_continual_config
from lightning_streamkl.options import Check, Choice, Count, Flag, Keywords, LayerRef, Number, Text, field_check

CONFIGS = [LayerPair, AttentionKLOptions, StreamKLConfig, ContinualConfig]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_carries_its_check_and_is_documented(cls):
    documented = "".join(inspect.getdoc(c) or "" for c in cls.__mro__ if dataclasses.is_dataclass(c))
    for f in dataclasses.fields(cls):
        assert isinstance(field_check(f), Check), f"{cls.__name__}.{f.name} has no check: declare it with option()"
        assert f"{f.name}:" in documented or f"``{f.name}``" in documented, f"{cls.__name__}.{f.name} is undocumented"


def test_constructors_expose_exactly_the_config_fields():
    callback = inspect.signature(StreamKLDistillation).parameters
    assert list(callback)[:2] == ["teacher", "pairs"] and list(callback)[-1] == "teacher_forward"
    assert set(callback) - {"teacher", "teacher_forward"} == {f.name for f in dataclasses.fields(StreamKLConfig)}
    continual = inspect.signature(ContinualAttentionRegularizer).parameters
    assert set(continual) - {"snapshot_forward"} == {f.name for f in dataclasses.fields(ContinualConfig)}
    for name, param in callback.items():  # the defaults are the config's (LightningCLI shows and uses them)
        if name in StreamKLConfig.__dataclass_fields__ and name != "pairs":
            assert param.default == getattr(StreamKLConfig(), name), name


def test_options_shared_by_the_two_configs_are_declared_once():
    shared = {f.name for f in dataclasses.fields(StreamKLConfig)} & {f.name for f in dataclasses.fields(ContinualConfig)}
    base = {f.name for f in dataclasses.fields(AttentionKLOptions)}
    assert shared == base  # anything the two have in common comes from AttentionKLOptions
    own = {f.name for f in dataclasses.fields(ContinualConfig) if f.name in inspect.get_annotations(ContinualConfig)}
    assert own & base == {"name"}  # the only shared option the continual config re-declares (another default)
    capture = field_check(StreamKLConfig.__dataclass_fields__["teacher_capture"])
    assert capture.choices == CAPTURE_KINDS  # the choices are the capture package's list, not a copy


def _other_value(check: Check, default):
    """A valid value different from ``default`` for a field's check."""
    if isinstance(check, Flag):
        return not default if default is not None else True
    if isinstance(check, Choice):
        return next(c for c in check.choices if c != default)
    if isinstance(check, Count):
        return check.low + 3
    if isinstance(check, Number):
        return (default or 1.0) + 0.5
    if isinstance(check, Keywords):
        return {"revision": "main"}
    if isinstance(check, LayerRef):
        return 3
    if isinstance(check, Text):
        return "other"
    raise AssertionError(f"no sample value for {type(check).__name__}")


@pytest.mark.parametrize(("cls", "validate"), [(StreamKLConfig, validate_config),
                                               (ContinualConfig, validate_continual_config)],
                         ids=["StreamKLConfig", "ContinualConfig"])
def test_every_field_goes_through_the_validator(cls, validate):
    """A non-default value of every field survives validation (none is dropped or reset on the way)."""
    raw = {}
    for f in dataclasses.fields(cls):
        check = field_check(f)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name == "pairs":
            raw[f.name] = [[1, 0]]
        elif f.name == "teacher_device":
            raw[f.name] = "cpu"
        elif f.name == "teacher_inputs":
            raw[f.name] = "batch"
        elif f.name == "snapshot_weights":
            raw.update(keep=2, snapshot_weights=[0.5, 0.5])
        elif f.name == "layers":
            raw[f.name] = [0, -1]
        elif f.name == "layer_weights":
            raw[f.name] = [1.0, 0.5]  # one per layer of `layers`
        elif f.name == "module":
            raw[f.name] = "model"
        elif f.name == "relations":
            raw[f.name] = ["qq", "kk", "vv"]
        elif f.name != "keep":
            raw[f.name] = _other_value(check, default)
    cfg = validate(raw)
    for name, value in raw.items():
        got = getattr(cfg, name)
        if name == "pairs":
            assert [(p.teacher, p.student) for p in got] == [(1, 0)]
        else:
            assert got == value, name
