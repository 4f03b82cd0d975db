"""Malformed config files get a ConfigError (CheckpointError for the adapter) naming the
field and the file, never a TypeError / KeyError / AttributeError traceback, and never a
silent conversion ("64" -> 64, 2.5 -> 2, true -> 1)."""

import copy
import json

import pytest

import packed_ss_jax as ps
from packed_ss_jax.nemotron import checkpoint as nemotron
from packed_ss_jax.checkpoints.errors import CheckpointError
from packed_ss_jax.config import ConfigError, ModelConfig, read_hf_config
from packed_ss_jax.families import parse_hf_config as from_hf_config
from tiny import tiny_config

NAN, INF = float("nan"), float("inf")
BAD_INTS = ["64", 2.5, True, [64], {"v": 64}]
BAD_FLOATS = ["1e-5", True, [1.0], NAN, INF]
BAD_BOOLS = ["false", 1, [True]]

# (path of the field in config.json, kind, required)
NEMOTRON_FIELDS = [
    (("hidden_size",), "int", True), (("num_attention_heads",), "int", True),
    (("num_hidden_layers",), "int", True), (("vocab_size",), "int", True),
    (("intermediate_size",), "int", True), (("head_dim",), "int", False),
    (("num_key_value_heads",), "int", False), (("mask_token_id",), "int", True),
    (("eos_token_id",), "int", False), (("bos_token_id",), "int", False),
    (("block_size",), "int", False), (("max_position_embeddings",), "int", False),
    (("rope_parameters", "original_max_position_embeddings"), "int", False),
    (("rms_norm_eps",), "float", False), (("rope_parameters", "rope_theta"), "float", False),
    (("rope_parameters", "factor"), "float", False),
    (("rope_parameters", "beta_fast"), "float", False),
    (("rope_parameters", "beta_slow"), "float", False),
    (("rope_parameters", "mscale"), "float", False),
    (("rope_parameters", "llama_4_scaling_beta"), "float", False),
    (("tie_word_embeddings",), "bool", False), (("rope_parameters",), "object", False),
]
SETDLM_FIELDS = [
    (("qwen3_config", "hidden_size"), "int", True),
    (("qwen3_config", "num_attention_heads"), "int", True),
    (("qwen3_config", "num_hidden_layers"), "int", True),
    (("qwen3_config", "vocab_size"), "int", True),
    (("qwen3_config", "intermediate_size"), "int", True),
    (("qwen3_config", "head_dim"), "int", False),
    (("qwen3_config", "num_key_value_heads"), "int", False),
    (("qwen3_config", "max_position_embeddings"), "int", False),
    (("backbone_config", "num_layers"), "int", False),
    (("noise_config", "desired_block_size"), "int", False),
    (("mask_token_id",), "int", True), (("eos_token_id",), "int", False),
    (("bos_token_id",), "int", False),
    (("qwen3_config", "rms_norm_eps"), "float", False),
    (("qwen3_config", "rope_theta"), "float", False),
    (("qwen3_config", "tie_word_embeddings"), "bool", False),
    (("backbone_config",), "object", False), (("noise_config",), "object", False),
    (("tokenization_config",), "object", False), (("qwen3_config",), "object", False),
]


def _bad_values(path, kind, required):
    bad = {"int": BAD_INTS, "float": BAD_FLOATS, "bool": BAD_BOOLS,
           "object": [[1, 2], "yarn", 3]}[kind]
    if path[-1] in ("eos_token_id", "bos_token_id"):  # a list of ids is allowed: its first
        bad = [b for b in bad if not isinstance(b, list)] + [["2"], [2.5], [None]]
    return bad + ([None] if required else [])


def _cases(fixtures):
    for family, fields in (("nemotron", NEMOTRON_FIELDS), ("setdlm", SETDLM_FIELDS)):
        base = json.loads((fixtures[family] / "config.json").read_text())
        for path, kind, required in fields:
            for bad in _bad_values(path, kind, required):
                cfg = copy.deepcopy(base)
                node = cfg
                for key in path[:-1]:
                    node = node[key]
                node[path[-1]] = bad
                yield family, path, bad, cfg


@pytest.fixture(scope="module")
def fixtures(nemotron_dir, setdlm_dir):
    return {"nemotron": nemotron_dir, "setdlm": setdlm_dir}


def test_every_field_of_the_wrong_type_names_the_field_and_the_file(fixtures, tmp_path):
    wrong = []
    for i, (family, path, bad, cfg) in enumerate(_cases(fixtures)):
        file = tmp_path / f"case{i}" / "config.json"
        file.parent.mkdir()
        file.write_text(json.dumps(cfg))
        what = f"{family} {'.'.join(path)}={json.dumps(bad)}"
        try:
            from_hf_config(read_hf_config(file.parent))
            wrong.append(f"{what}: accepted")
        except ConfigError as e:
            if path[-1] not in str(e) or str(file) not in str(e):
                wrong.append(f"{what}: the message does not name the field and the file: {e}")
        except Exception as e:  # noqa: BLE001 - any other exception is the defect
            wrong.append(f"{what}: {type(e).__name__}: {e}")
    assert not wrong, f"{len(wrong)} cases:\n" + "\n".join(wrong)
    # while null, where a field is optional, still takes its default (as transformers does)
    cfg = json.loads((fixtures["nemotron"] / "config.json").read_text())
    cfg.update(head_dim=None, num_key_value_heads=None, block_size=None, eos_token_id=None)
    c = from_hf_config(cfg)
    assert (c.head_dim, c.num_kv_heads, c.block_size, c.eos_token_id) == (16, 4, 32, None)
    cfg["max_position_embeddings"] = 128.0  # an integral float, as some writers emit
    assert from_hf_config(cfg).max_position_embeddings == 128


def test_config_files_that_are_not_json_objects(tmp_path):
    """A list, a string, a number, null, empty, truncated, Latin-1 or UTF-16 bytes: a
    ConfigError naming the file."""
    contents = [b"[1, 2]", b'"config"', b"3", b"null", b"", b'{"model_type": "nemotron',
                '{"name": "caf\u00e9"}'.encode("latin-1"), '{"a": 1}'.encode("utf-16")]
    wrong = []
    for i, content in enumerate(contents):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "config.json").write_bytes(content)
        try:
            ps.load(d)
            wrong.append(f"{content!r}: accepted")
        except ConfigError as e:
            if str(d / "config.json") not in str(e):
                wrong.append(f"{content!r}: the message does not name the file: {e}")
        except Exception as e:  # noqa: BLE001 - any other exception is the defect
            wrong.append(f"{content!r}: {type(e).__name__}: {e}")
    assert not wrong, "\n".join(wrong)


def test_a_directory_named_config_json(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="config.json is a directory"):
        ps.load(tmp_path)
    with pytest.raises(ConfigError, match="is a directory"):
        read_hf_config(tmp_path / "config.json")


ADAPTER = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ["o_proj"]}


def _without(key):
    return {k: v for k, v in ADAPTER.items() if k != key}


ADAPTER_CASES = [
    (_without("r"), "'r'"), (_without("lora_alpha"), "'lora_alpha'"),
    (dict(ADAPTER, r=None), "'r'"), (dict(ADAPTER, r="4"), "'r'"), (dict(ADAPTER, r=2.5), "'r'"),
    (dict(ADAPTER, r=0), "'r'"), (dict(ADAPTER, r=True), "'r'"),
    (dict(ADAPTER, lora_alpha="16"), "'lora_alpha'"), (dict(ADAPTER, lora_alpha=[16]), "'lora_alpha'"),
    (dict(ADAPTER, target_modules="o_proj"), "target_modules"),
    (dict(ADAPTER, target_modules=7), "target_modules"),
    ('{"r": 4,', "not valid JSON"), ("[4, 16]", "JSON object"), (b"\xff\xfe", "UTF-8"),
]


def test_bad_adapter_configs_name_the_file_and_the_key(tmp_path):
    wrong = []
    for i, (content, key) in enumerate(ADAPTER_CASES):
        lora = tmp_path / str(i) / nemotron.LORA_DIR
        lora.mkdir(parents=True)
        file = lora / "adapter_config.json"
        if isinstance(content, dict):
            content = json.dumps(content)
        file.write_bytes(content if isinstance(content, bytes) else content.encode())
        try:
            nemotron.lora_config(tmp_path / str(i))
            wrong.append(f"{content!r}: accepted")
        except CheckpointError as e:
            if str(file) not in str(e) or key not in str(e):
                wrong.append(f"{content!r}: the message does not name the file and {key}: {e}")
        except Exception as e:  # noqa: BLE001 - any other exception is the defect
            wrong.append(f"{content!r}: {type(e).__name__}: {e}")
    assert not wrong, "\n".join(wrong)


def test_adapter_config_that_is_a_directory(tmp_path):
    (tmp_path / nemotron.LORA_DIR / "adapter_config.json").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="adapter_config.json is a directory"):
        nemotron.lora_config(tmp_path)


def test_model_config_fields_are_typed():
    """A converted checkpoint's stored config (`ModelConfig.from_dict`) is held to the
    same types: a string size would otherwise reach the compiled programs."""
    changes = [dict(vocab_size="12"), dict(hidden_size=32.0), dict(num_layers=True),
               dict(eos_token_id=1.5), dict(rms_norm_eps="1e-5"), dict(rope_theta=NAN),
               dict(qk_norm="no"), dict(tie_embeddings=0), dict(block_size=0),
               dict(lora_rank=-1), dict(max_position_embeddings=None)]
    wrong = []
    for change in changes:
        (field,) = change
        try:
            ModelConfig.from_dict(dict(tiny_config().to_dict(), **change))
            wrong.append(f"{change}: accepted")
        except ConfigError as e:
            if field not in str(e):
                wrong.append(f"{change}: the message does not name the field: {e}")
        except Exception as e:  # noqa: BLE001 - any other exception is the defect
            wrong.append(f"{change}: {type(e).__name__}: {e}")
    assert not wrong, "\n".join(wrong)


def test_model_config_from_something_else():
    with pytest.raises(ConfigError, match="mapping"):
        ModelConfig.from_dict([("vocab_size", 12)])
    with pytest.raises(ConfigError, match=r"missing: \[.*'hidden_size'"):
        ModelConfig.from_dict({"family": "nemotron", "vocab_size": 12})
