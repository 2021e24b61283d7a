# Sourced by demo.sh and test.sh: make and enter .venv, install torch and ptdp with the
# extras named in $PTDP_EXTRAS (e.g. "[test]").
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
# torch==2.13.0 takes the CPU wheel on these machines; a GPU user's own torch is kept.
python -c "import torch" 2>/dev/null || pip install --quiet torch==2.13.0
pip install --quiet -e ".${PTDP_EXTRAS:-}"
