"""Structured configs: one validation routine behind the constructors and the YAML loader."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from torch import nn

from lightning_streamkl import (
    LayerPair,
    StreamKLConfig,
    StreamKLDistillation,
    load_config,
    to_yaml,
    uniform_pairs,
    validate_config,
)

TEACHER = nn.MultiheadAttention(8, 2)


def test_yaml_round_trip(tmp_path):
    cfg = validate_config({
        "pairs": [LayerPair(teacher="model.layers.11.self_attn", student=-1, weight=2.0, temperature=2.0,
                            direction="reverse", causal=True, head_map="group", name="deep"), [3, 1, 0.5]],
        "weight": 0.1, "warmup_steps": 100, "temperature": 1.5, "causal": False, "teacher_dtype": None,
        "mask_key": None, "validation": False, "name": "kd", "backend": "reference",
    })
    path = tmp_path / "kd.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg
    assert load_config(str(path)) == cfg
    assert load_config(OmegaConf.load(path)) == cfg
    assert OmegaConf.to_object(OmegaConf.structured(cfg)) == cfg  # a real omegaconf structured config


def test_yaml_interpolation_and_key_selection():
    text = """
    experiment:
      temperature: 3.0
    model:
      distill:
        pairs:
          - {teacher: 5, student: 2}
        temperature: ${experiment.temperature}
    """
    cfg = load_config(text, key="model.distill")
    assert cfg.temperature == 3.0 and cfg.pairs[0].label == "t5_s2"
    with pytest.raises(ValueError, match=r"Expected the config to contain `model\.missing`"):
        load_config(text, key="model.missing")


BAD = [
    ({"pairs": [[1, 0]], "temprature": 2.0}, ValueError,
     "Unknown key `temprature` in the StreamKL config. Did you mean `temperature`?"),
    ({"pairs": [{"teacher": 1, "student": 0, "wieght": 2}]}, ValueError,
     r"Unknown key `pairs\[0\].wieght` in the StreamKL config. Did you mean `pairs\[0\].weight`?"),
    ({"pairs": [[1, 0]], "weight": -1}, ValueError, "Expected `weight` to be a finite number >= 0, but got -1.0."),
    ({"pairs": [[1, 0]], "temperature": 0}, ValueError, "Expected `temperature` to be a finite number > 0, but got 0.0."),
    ({"pairs": [[1, 0]], "temperature": "hot"}, TypeError, "Expected `temperature` to be a finite number > 0, but got 'hot'."),
    ({"pairs": [[1, 0]], "direction": "sideways"}, ValueError,
     r"Expected `direction` to be one of \('forward', 'reverse'\), but got 'sideways'."),
    ({"pairs": [{"teacher": 1, "student": 0, "head_map": "mean"}]}, ValueError,
     r"Expected `pairs\[0\].head_map` to be one of \('error', 'group'\) or None, but got 'mean'."),
    ({"pairs": [{"teacher": 1.5, "student": 0}]}, TypeError,
     r"Expected `pairs\[0\].teacher` to be a layer index \(int\) or a module path \(non-empty str\), but got 1.5."),
    ({"pairs": [{"student": 0}]}, ValueError, r"Missing `pairs\[0\].teacher`"),
    ({"pairs": []}, ValueError, r"Expected `pairs` to be a non-empty list of layer pairs, but got \[\]."),
    ({"pairs": [[1, 0], [1, 0]]}, ValueError, r"Expected `pairs` to have unique names, but \['t1_s0'\] occur more"),
    ({"pairs": [{"teacher": 1, "student": 0, "name": "total"}]}, ValueError, "Expected no pair to be named 'total'"),
    ({"pairs": [[1, 0]], "warmup_steps": -3}, ValueError, "Expected `warmup_steps` to be an int >= 0, but got -3."),
    ({"pairs": [[1, 0]], "causal": "yes"}, TypeError, "Expected `causal` to be a bool or None, but got 'yes'."),
    ({"pairs": [[1, 0]], "teacher_capture": "hooks"}, ValueError, "Expected `teacher_capture` to be one of"),
    ({"pairs": [[1, 0]], "name": "my kd"}, ValueError, "Expected `name` to be a non-empty string without spaces"),
    ({"pairs": [[1, 0]], "teacher_device": "offlaod"}, ValueError,
     r"Expected `teacher_device` to be one of \('student', 'keep', 'offload'\) or a torch device such as 'cpu' or "
     r"'cuda:1', but got 'offlaod'."),
]


@pytest.mark.parametrize(("raw", "exc", "message"), BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_values_fail_with_the_same_message_from_python_and_yaml(raw, exc, message):
    with pytest.raises(exc, match=message):
        validate_config(raw)
    with pytest.raises(exc, match=message):  # YAML text
        load_config(OmegaConf.to_yaml(OmegaConf.create(raw)))
    options = dict(raw)
    pairs = options.pop("pairs")
    if all(k in StreamKLConfig.__dataclass_fields__ for k in options):
        with pytest.raises(exc, match=message):  # the callback's constructor
            StreamKLDistillation(TEACHER, pairs=pairs, **options)


def test_constructor_options_match_the_config_fields():
    import inspect

    params = set(inspect.signature(StreamKLDistillation).parameters) - {"teacher", "teacher_forward"}
    assert params == set(StreamKLConfig.__dataclass_fields__)


def test_from_config_and_defaults():
    cb = StreamKLDistillation.from_config(TEACHER, {"pairs": [[0, 0]], "temperature": 4.0})
    assert cb.config.temperature == 4.0 and cb.config.direction == "forward" and cb.config.name == "attn_kl"
    assert cb.config == StreamKLDistillation(TEACHER, pairs=[[0, 0]], temperature=4.0).config
    with pytest.raises(TypeError, match=r"Expected `teacher` to be a torch\.nn\.Module or the name/path"):
        StreamKLDistillation(42, pairs=[[0, 0]])


def test_pair_helpers():
    assert [(p.teacher, p.student) for p in uniform_pairs(6, 3)] == [(1, 0), (3, 1), (5, 2)]
    assert sum(p.weight for p in uniform_pairs(7, 3, weight=2.0)) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="Expected the student's layers to be at most the teacher's, but got 4 > 2"):
        uniform_pairs(2, 4)
    with pytest.raises(ValueError, match="Expected `teacher` to be a model or a number of layers >= 1, but got 0"):
        uniform_pairs(0, 1)


def test_layer_mapping_helpers_count_the_layers_of_the_models_themselves():
    from torch import nn

    from lightning_streamkl import explicit_pairs, last_k_pairs, layer_count

    from ._models import tiny_bert, tiny_llama

    teacher, student = tiny_llama(layers=6), tiny_bert(layers=2)
    assert layer_count(teacher) == 6 and layer_count(student) == 2  # found by the Hugging Face capture
    assert [(p.teacher, p.student, p.weight) for p in uniform_pairs(teacher, student)] == [(2, 0, 0.5), (5, 1, 0.5)]
    assert [(p.teacher, p.student, p.label) for p in last_k_pairs(2, teacher, student)] == [(-2, -2, "last-1"),
                                                                                          (-1, -1, "last")]
    with pytest.raises(ValueError, match="Expected `k` to be at most the student's 2 attention layers, but got 3"):
        last_k_pairs(3, teacher, student)
    pairs = explicit_pairs({0: 1, 1: "model.layers.5.self_attn"}, weight=2.0, temperature=2.0)
    assert [(p.teacher, p.student, p.weight, p.temperature) for p in pairs] == [
        (1, 0, 1.0, 2.0), ("model.layers.5.self_attn", 1, 1.0, 2.0)]
    with pytest.raises(ValueError, match=r"Expected `student` \(Linear\) to have attention layers"):
        uniform_pairs(teacher, nn.Linear(2, 2))
    with pytest.raises(ValueError, match="non-empty"):
        explicit_pairs({})
