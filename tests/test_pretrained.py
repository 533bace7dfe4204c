"""Checkpoint plumbing shared by the models: key maps, strict loading, atomic saves."""
import dataclasses
import json

import pytest
import torch
from torch import nn

from fusedlm.models import Config, KeyMap, KeyRule, PreTrainedModel

pytest.importorskip("safetensors")


@dataclasses.dataclass
class TinyConfig(Config):
    model_type = "tiny"
    hidden_size: int = 4
    num_layers: int = 2


class Tiny(PreTrainedModel):
    config_class = TinyConfig
    key_map = KeyMap([KeyRule("blocks.*.proj.weight", "h.*.c_proj.weight", transpose=True),
                      KeyRule("blocks.*.proj.bias", "h.*.c_proj.bias")])

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"proj": nn.Linear(config.hidden_size, 2 * config.hidden_size)})
            for _ in range(config.num_layers))


def _model():
    torch.manual_seed(0)
    return Tiny(TinyConfig())


def test_key_map_renames_both_ways_and_transposes():
    state = _model().state_dict()
    theirs = Tiny.key_map.to_theirs(state)
    assert set(theirs) == {"h.0.c_proj.weight", "h.0.c_proj.bias", "h.1.c_proj.weight",
                           "h.1.c_proj.bias"}
    assert theirs["h.1.c_proj.weight"].shape == (4, 8)
    back = Tiny.key_map.to_ours(theirs)
    assert set(back) == set(state)
    for k in state:
        torch.testing.assert_close(back[k], state[k])


def test_save_then_load_gives_the_same_weights(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "tiny"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left

    loaded = Tiny.from_pretrained(tmp_path)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=k)


def test_loading_names_every_missing_extra_and_misshaped_tensor():
    model = _model()
    state = model.state_dict()
    del state["blocks.0.proj.bias"]
    state["blocks.9.proj.bias"] = torch.zeros(8)
    state["blocks.1.proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as err:
        model.load_checked(state)
    message = str(err.value)
    assert "missing: blocks.0.proj.bias" in message
    assert "unexpected: blocks.9.proj.bias" in message
    assert "blocks.1.proj.weight: checkpoint (3, 3), model (8, 4)" in message


def test_config_ignores_foreign_fields_and_rejects_another_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "tiny", "hidden_size": 6, "architectures": ["X"]}))
    assert TinyConfig.load(tmp_path) == TinyConfig(hidden_size=6)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2'"):
        TinyConfig.load(tmp_path)
