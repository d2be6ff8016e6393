"""Operations: what connects gpupool to Prometheus and Grafana (file-based service discovery)."""

from gpupool.ops.sd_file import (
    SD_FILE,
    sd_file_path,
    sd_targets,
    write_sd_file,
    write_sd_targets,
)

__all__ = ["SD_FILE", "sd_file_path", "sd_targets", "write_sd_file", "write_sd_targets"]
