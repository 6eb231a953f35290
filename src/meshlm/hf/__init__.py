"""Hugging Face import/export: `load(path) -> (cfg, params)` and `save(cfg, params, path)`.

`path` is a Hugging Face model directory: `config.json` plus `model.safetensors` or sharded
`model-*.safetensors` with `model.safetensors.index.json`. Each family file maps its names (see
meshlm.hf.maps for the protocol). `meshlm convert` (meshlm.commands.convert) wraps both for the CLI.
"""
from meshlm.hf.io import hf_config, load, save

__all__ = ["hf_config", "load", "save"]
