"""Config: Megatron-style flags, YAML defaults, and errors that name the flag."""

import pytest

from megatron_klear.config import ConfigError, TrainConfig, parse_config
from megatron_klear.models.qwen3 import ConfigError as ModelConfigError
from megatron_klear.models.qwen3 import padded_vocab_size, qwen3_config_from_hf, transformer_config
from megatron_klear.models.tiny import tiny_qwen3_config


def test_flags_and_yaml(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("tensor-model-parallel-size: 2\nlr: 1\nlr_decay_style: cosine\nmin_lr: 0.5\n")
    cfg = parse_config(TrainConfig, ["--config", str(y), "--lr", "2e-5", "--min-lr", "1e-6",
                                     "--bf16", "--global-batch-size", "16"])
    assert cfg.tensor_model_parallel_size == 2 and cfg.lr == 2e-5 and cfg.min_lr == 1e-6
    assert cfg.lr_decay_style == "cosine" and cfg.bf16 and cfg.global_batch_size == 16


@pytest.mark.parametrize("argv,flag", [
    (["--global-batch-size", "6", "--micro-batch-size", "4"], "--global-batch-size"),
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size"),
    (["--export-hf-interval", "10"], "--export-hf-interval needs --export-hf"),
    (["--export-hf", "x", "--export-hf-interval", "-1"], "--export-hf-interval"),
])
def test_inconsistent_values_name_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        parse_config(TrainConfig, argv)


def test_unknown_yaml_key(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("tensor-parallel: 2\n")
    with pytest.raises(ConfigError, match="tensor-parallel"):
        parse_config(TrainConfig, ["--config", str(y)])


def test_unknown_flag_exits():
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--no-such-flag", "1"])


def test_dp_size_checks_world():
    cfg = TrainConfig(tensor_model_parallel_size=2, global_batch_size=8, micro_batch_size=2)
    assert cfg.data_parallel_size(4) == 2
    with pytest.raises(ConfigError, match="does not divide"):
        cfg.data_parallel_size(3)


def test_qwen3_config_errors():
    with pytest.raises(ModelConfigError, match="model_type='qwen2_moe'.*supported: Qwen3"):
        qwen3_config_from_hf(tiny_qwen3_config(model_type="qwen2_moe"))
    with pytest.raises(ModelConfigError, match="supported: Qwen3"):  # type/class disagree
        qwen3_config_from_hf(tiny_qwen3_config(model_type="qwen3_moe"))
    arch = qwen3_config_from_hf(tiny_qwen3_config())
    with pytest.raises(ModelConfigError, match="--tensor-model-parallel-size 4 .*num_key_value_heads"):
        transformer_config(arch, tp=4)
    with pytest.raises(ModelConfigError, match="--pipeline-model-parallel-size 3"):
        transformer_config(arch, pp=3)
    assert padded_vocab_size(103, 2) == 256 and padded_vocab_size(151936, 1) == 151936


def test_rope_theta_from_rope_parameters_and_yarn():
    cfg = tiny_qwen3_config()
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                              "original_max_position_embeddings": 128}
    arch = qwen3_config_from_hf(cfg)
    assert arch.rope_theta == 5e5 and arch.rope_scaling["factor"] == 4.0
    tconf = transformer_config(arch)
    assert tconf.yarn_rotary_scaling_factor == 4.0
    assert tconf.yarn_original_max_position_embeddings == 128


def test_a_part_receives_its_section_only():
    """``cfg.part(Section)``: the section's own flags as an object of that section (what a
    part of the trainer receives), with the parsed values; no other section's flags."""
    import dataclasses

    from megatron_klear.train.rl import RLConfig
    from megatron_klear.train.rl_data import DynamicSamplingFlags

    cfg = parse_config(RLConfig, ["--hf-checkpoint", "x", "--prompt-data", "x",
                                  "--max-gen-rounds", "1", "--filter-groups-metric", "acc"])
    part = cfg.part(DynamicSamplingFlags)
    assert type(part) is DynamicSamplingFlags
    assert {f.name for f in dataclasses.fields(part)} == set(DynamicSamplingFlags.section_fields())
    assert (part.max_gen_rounds, part.filter_groups_metric) == (1, "acc")
    assert not hasattr(part, "rollout_batch_size")
