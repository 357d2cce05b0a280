# Sourced by the GPU scripts: DeepSpeed and its dependencies from .whl/ (benchmarks/deepspeed_wheels.sh), when
# that directory was carried along, installed into a temporary directory put on PYTHONPATH after the repository
# (ahead of the image's site-packages: only DeepSpeed's own set). The image's torch, numpy and the rest stay
# (--no-deps). Nothing happens without .whl/*.whl.
if compgen -G ".whl/*.whl" > /dev/null; then
  WHEELS_SITE="$(mktemp -d -t gpu-wheels-site-XXXXXX)"
  "${PYTHON:-python}" -m pip install -q --no-index --no-deps --no-compile --target "$WHEELS_SITE" .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$WHEELS_SITE"
fi
