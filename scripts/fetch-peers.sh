#!/usr/bin/env bash
# Download, on a machine that reaches the package index, the wheels a GPU machine that reaches
# none needs for `scripts/gpu-check.sh`: the peers `benchmarks/speed/mfu.py --compare` trains
# (TorchTitan 0.3.0, Megatron-Core 0.16.1, torchao 0.18.0 for fp8), their dependencies, and
# pytest-xdist and ptdp's test extras for `gpu-check.sh --suite`, into peers/wheels (git ignores
# it). Never torch, triton or nvidia-* / cuda-*: the GPU machine keeps its own CUDA build of
# torch. gpu-check.sh installs from that folder, without an index, the peers and whatever of the
# rest the machine lacks, into peers/site, a folder put on PYTHONPATH for its Python runs only.
#
#   bash scripts/fetch-peers.sh                       # then carry peers/wheels to the GPU machine
#   PTDP_PEER_HAVE=runs/gpu-check/DATE/pip-freeze.txt bash scripts/fetch-peers.sh
#
# Environment: PTDP_PEER_WHEELS=DIR the folder (default peers/wheels); PTDP_PEER_PYTHON the GPU
# machine's Python version (default 3.12), for which the set is resolved and compiled wheels are
# chosen; PTDP_PEER_HAVE=FILE the GPU machine's packages, one `name` or `name==version` a line
# (gpu-check.sh writes pip-freeze.txt into its results): none of them is fetched (but the peers
# always are), which keeps the folder small; PYTHON the interpreter whose pip resolves.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${PTDP_PEER_WHEELS:-peers/wheels}
VERSION=${PTDP_PEER_PYTHON:-3.12}
HAVE=${PTDP_PEER_HAVE:-}
PY=${PYTHON:-python3}
PEERS=(torchtitan==0.3.0 megatron-core==0.16.1 torchao==0.18.0)
SUITE=(pytest pytest-timeout pytest-xdist transformers safetensors datasets tokenizers tqdm
  matplotlib numpy)
TAGS=(--only-binary=:all: --python-version "$VERSION" --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform any)
mkdir -p "$DEST"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The whole set, resolved as pip would install it for that Python into an empty folder.
"$PY" -m pip install --quiet --dry-run --ignore-installed --target "$work/t" "${TAGS[@]}" \
  --report "$work/report.json" "${PEERS[@]}" "${SUITE[@]}"
mapfile -t PINS < <("$PY" - "$work/report.json" "$HAVE" "${PEERS[@]}" <<'PYEOF'
import json, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
report, have_file, peers = sys.argv[1], sys.argv[2], {norm(p.split("==")[0]) for p in sys.argv[3:]}
have = set()
if have_file:
    for line in open(have_file):
        if name := re.split(r"[=<>@ ;\[]", line.strip(), maxsplit=1)[0]:
            have.add(norm(name))
never = re.compile(r"^(torch|triton|pytorch-triton|nvidia-.*|cuda-.*)$")
for item in json.load(open(report))["install"]:
    name, version = norm(item["metadata"]["name"]), item["metadata"]["version"]
    if not never.match(name) and (name in peers or name not in have):
        print(f"{name}=={version}")
PYEOF
)
echo "fetching ${#PINS[@]} packages for Python $VERSION into $DEST${HAVE:+ (leaving out those in $HAVE)}"
"$PY" -m pip download --quiet --no-deps "${TAGS[@]}" --dest "$DEST" "${PINS[@]}"
printf '%s\n' "${PINS[@]}" > "$DEST/pins.txt"
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1); pins in $DEST/pins.txt"
