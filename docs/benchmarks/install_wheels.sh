# Sourced by the GPU-machine scripts: `source docs/benchmarks/install_wheels.sh [WHEEL_DIR]`
# installs the carried wheels (default .whl) into /tmp/site and puts it on PYTHONPATH/PATH.
# pytest's wheels only where the image lacks pytest: a second copy would shadow its plugins.
skip=""
python3 -c "import pytest" 2>/dev/null && skip="pytest pluggy iniconfig"
wheels=()
for w in "${1:-.whl}"/*.whl; do
  name=$(basename "$w" | cut -d- -f1)
  case " $skip " in *" $name "*) continue ;; esac
  wheels+=("$w")
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "${wheels[@]}" || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
