# A GPU host's worker image: the official vLLM image with gpupool installed beside it, gpupool
# supervising vLLM inside the container (launch: workers: restarts with backoff, readiness,
# warm-up, drain on SIGTERM, GPU-keyed compile and Triton caches). Build from the repository
# root:
#
#   docker build -f docker/worker.Dockerfile -t gpupool-worker:latest .
#   docker run -d --gpus all --ipc host -p 8000:8000 \
#       -v gpupool-state:/var/lib/gpupool -v hf-models:/models gpupool-worker:latest
#
# The default configuration (docker/gpupool.worker.yaml) is seed 000's layout: Qwen3.5-35B-A3B
# on GPU 0 (RTX PRO 6000, warms the shared Triton cache) and GPU 1 (RTX 5090, starts after).
# Mount another at /etc/gpupool/gpupool.yaml for other cards. The caches live under
# /var/lib/gpupool/cache/<sm_XY> (one per GPU architecture): keep that on a volume, or every
# container start compiles and autotunes again. A front gateway lists this container's port as a
# `url:` worker or finds it by DNS (deploy/kubernetes: a StatefulSet and a headless Service).
#
# gpupool lives in its own virtual environment (/opt/gpupool), so its pinned dependencies never
# touch vLLM's; `vllm` stays the image's own. Air-gapped: docker/wheels/ must then hold wheels
# built for the vLLM image's Python (PYTHON=python3.12 docker/wheels.sh on a matching host).
# No `# syntax=` line, as in docker/Dockerfile: nothing to pull but the base.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /src
COPY docker/wheels/ /wheelhouse/
COPY pyproject.toml README* ./
COPY gpupool ./gpupool
RUN python3 -m venv /opt/gpupool \
    && if ls /wheelhouse/*.whl >/dev/null 2>&1; then \
           /opt/gpupool/bin/pip install --no-index --find-links /wheelhouse . ; \
       else \
           /opt/gpupool/bin/pip install . ; \
       fi \
    && ln -s /opt/gpupool/bin/gpupool /usr/local/bin/gpupool \
    && rm -rf /src /wheelhouse \
    && mkdir -p /etc/gpupool /var/lib/gpupool /models
COPY docker/gpupool.worker.yaml /etc/gpupool/gpupool.yaml
ENV HF_HOME=/models/huggingface
WORKDIR /var/lib/gpupool
EXPOSE 8000
# gpupool answers /health while it runs and /ready once every model has a ready worker; a first
# start downloads, compiles and autotunes for many minutes (start-period).
HEALTHCHECK --interval=15s --timeout=5s --start-period=30m --retries=3 \
    CMD ["/opt/gpupool/bin/python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=3)"]
ENTRYPOINT ["gpupool"]
CMD ["serve", "--config", "/etc/gpupool/gpupool.yaml"]
