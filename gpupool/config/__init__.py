from gpupool.config.load import ConfigError, load_config, parse_config
from gpupool.config.models import GpupoolConfig

__all__ = ["ConfigError", "GpupoolConfig", "load_config", "parse_config"]
