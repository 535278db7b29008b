"""Review: config.json values that load but make the model compute NaN (reported later as "NaN logits: try another
dtype") are refused as ConfigErrors that name the entry."""
import pytest

from mpk_runtime.models import ConfigError, ModelConfig, PRESETS, load_config


@pytest.mark.parametrize("key,value", [("rope_theta", 0), ("rope_theta", -10000.0), ("rope_theta", 1.0),
                                       ("rms_norm_eps", -1e-6)])
def test_a_rope_base_or_norm_eps_that_breaks_the_math_is_a_config_error(tmp_path, key, value):
    import json
    hf = PRESETS["tiny-qwen3"].to_hf_config()
    hf[key] = value
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=key):
        load_config(str(tmp_path))
    with pytest.raises(ConfigError, match=key):
        PRESETS["tiny-llama"].replace(**{key: value})


def test_sane_rope_bases_and_eps_still_load():
    hf = PRESETS["tiny-qwen3"].to_hf_config()
    for theta in (10000, 1e6, 500000.0):
        assert ModelConfig.from_hf_config({**hf, "rope_theta": theta}).rope_theta == theta
    assert ModelConfig.from_hf_config({**hf, "rms_norm_eps": 0.0}).rms_norm_eps == 0.0
