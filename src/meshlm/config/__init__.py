"""Config: pydantic schema, YAML presets and dotted key=value overrides."""
from meshlm.config.loader import load_config, load_preset, parse_overrides, preset_names, to_yaml
from meshlm.config.schema import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig

__all__ = ["Config", "DataConfig", "MeshConfig", "ModelConfig", "TrainConfig", "load_config",
           "load_preset", "parse_overrides", "preset_names", "to_yaml"]
