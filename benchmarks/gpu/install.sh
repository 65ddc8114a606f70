#!/usr/bin/env bash
# Install the project on the GPU host as a user would: its wheel with its dependencies, from the
# wheels carried in .whl (the host reaches no package index), into the host's Python. Then say
# which coordinator a job started outside this checkout imports.
#   python3 -m pip wheel --no-deps -w .whl .          # here, before the device call
#   cp ../shared/wheels/device-cp312/redis-*.whl .whl/ # dependencies the GPU host lacks (redis-py)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d .whl ] || { echo "install.sh: no .whl dir with the project's wheel: see the top of this script" >&2; exit 1; }
if ! python3 -m pip install -q --no-index --find-links .whl --no-cache-dir .whl/torch_compile_coordinator-*.whl; then
  # pip re-checks the requirements of what is installed (torch's own); where the host's copy of
  # one of those is older than torch's metadata asks, install the carried wheels as they are.
  echo "install.sh: pip could not resolve every requirement from .whl; installing the carried wheels without it"
  python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl
fi
cd /tmp && python3 -c "import coordinator, redis; print('coordinator', coordinator.__version__, 'at', coordinator.__file__, '| redis-py', redis.__version__)"
