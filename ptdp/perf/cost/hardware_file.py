"""Hardware files: a cluster read from TOML, every number checked before it is believed.

A system (`ptdp.perf.cost.hardware.System`) is one TOML file (the shipped ones are in
`ptdp/perf/cost/hardware/`; a user passes the path of their own): `[device]` (peak rates by
`kind` from `ptdp.perf.cost.flops.DENSE_PEAK_TFLOPS` or an explicit `peak_tflops` table,
memory, HBM bandwidth), `[device.achieved]` (the calibration: achieved GEMM and memory efficiency, a
kernel launch cost, and optionally `reserved_gib`, memory held beside the model's count
(absent: `ptdp.perf.cost.reserve` prices it per layout and rank); from `ptdp calibrate` also a
GEMM efficiency curve over size, `gemm_curve_flops` and `gemm_curve_efficiency`, the fused
attention kernel's own efficiency and backward / forward ratio, and on CPUs the per-layer
framework cost and `collective_sync_us`, what each blocking collective costs beyond its
bytes), `[node]` (GPUs per node, their NVLink/NVSwitch link and optionally
`host_memory_gib`, the node's host memory its GPUs' ranks share, `ptdp.perf.cost.host_memory`)
and `[network]` (the inter-node link per GPU, e.g. one InfiniBand HCA each). Bandwidths
are per GPU and per direction, in GB/s (1e9 bytes); `latency_us` per message or collective call,
`step_latency_us` per step of a ring collective; `p2p_latency_us` and `p2p_bandwidth_gb_s`
(from `ptdp calibrate`) price point-to-point messages apart from the collectives, and
`<op>_latency_us` / `<op>_bandwidth_gb_s` (op: all_reduce, all_gather, reduce_scatter,
all_to_all) one collective apart from the others.

Built in: `a100-80gb` (the paper's Selene nodes: DGX A100 80GB, 8x 200 Gb/s HDR per
node), `a100-40gb`, `h100-sxm` and `h200` (their GEMM curve fitted to Megatron-Core's
published H100 weak-scaling table, `ptdp.perf.validate.published`), and `mi250x` (Frontier's nodes,
from AMD's and HPE's specifications and published GEMM, STREAM, link and RCCL measurements).

Each number is checked against its domain (`NUMBERS`, with `ptdp.rules.domains`' rules)
before the file is parsed, so an impossible file (a zero bandwidth, an efficiency above 1,
a fractional GPU count) is refused naming the key, its value and the rule.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

from ptdp.errors import ConfigError
from ptdp.perf.cost.flops import DENSE_PEAK_TFLOPS
from ptdp.perf.cost.hardware import GB, GIB, LINK_OPS, Device, Link, System
from ptdp.rules import domains

BUILTIN_DIR = Path(__file__).with_name("hardware")


def list_systems() -> list[str]:
    """Names of the built-in systems."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def load_system(name_or_path: str | Path) -> System:
    """A built-in system by name (`a100-80gb`) or a TOML file by path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = BUILTIN_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ConfigError(
            f"unknown hardware {str(name_or_path)!r}: not a file and not one of "
            f"{', '.join(list_systems())}; see ptdp/perf/cost/hardware/*.toml for the format"
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"hardware file {path} is not valid TOML: {exc}; {FORMAT}") from None
    check_numbers(data, path)
    try:
        return _parse(data, path.stem)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"hardware file {path}: {exc!r}; {FORMAT}") from None


FORMAT = f"see {BUILTIN_DIR / 'a100-80gb.toml'} for the format"
NUMBERS: tuple[tuple[str, str, str, bool], ...] = (
    ("device", "memory_gib", "positive", True),
    ("device", "memory_bandwidth_gb_s", "positive", True),
    ("device.achieved", "gemm_efficiency", "fraction", False),
    ("device.achieved", "memory_efficiency", "positive", False),  # caches may beat HBM
    ("device.achieved", "kernel_overhead_us", "non-negative", False),
    ("device.achieved", "reserved_gib", "non-negative", False),
    ("device.achieved", "collective_sync_us", "non-negative", False),
    ("device.achieved", "wait_after_compute_us", "non-negative", False),
    ("device.achieved", "ring_sync_us", "non-negative", False),
    ("device.achieved", "split_backward_ratio", "positive", False),
    ("node", "gpus", "count", True),
    ("node", "host_memory_gib", "positive", False),
    *(
        (link, key, kind, key == "bandwidth_gb_s")
        for link in ("node", "network")
        for key, kind in (
            ("bandwidth_gb_s", "positive"),
            ("efficiency", "fraction"),
            ("latency_us", "non-negative"),
            ("step_latency_us", "non-negative"),
            ("p2p_latency_us", "non-negative"),
            ("p2p_bandwidth_gb_s", "positive"),
            *(
                (f"{op}_{key}", kind)
                for op in LINK_OPS
                for key, kind in (("latency_us", "non-negative"), ("bandwidth_gb_s", "positive"))
            ),
        )
    ),
)
"""(table, key, rule, required) for every number of a hardware file."""
RULES = {  # ptdp/rules/domains.py's, shared with the config keys: finite, and in the range
    "positive": domains.POSITIVE,
    "fraction": domains.FRACTION,
    "non-negative": domains.NON_NEGATIVE,
    "count": domains.COUNT,
}


def check_numbers(data: dict[str, Any], path: Path) -> None:
    """Refuse a hardware file whose tables or numbers are impossible (a zero bandwidth, an
    efficiency above 1, a fractional GPU count...), naming the key, its value and the rule."""
    for table, key, rule, required in NUMBERS:
        values = _table(data, table, path)
        if key not in values:
            if required:
                raise ConfigError(f"hardware file {path}: [{table}] lacks {key}; {FORMAT}")
            continue
        _check_number(path, f"[{table}] {key}", values[key], rule)
    for precision, value in _table(data, "device.peak_tflops", path).items():
        _check_number(path, f"[device] peak_tflops.{precision}", value, "positive")
    if bad := domains.non_finite(data):  # the curves, pairs and keys without a rule above
        raise ConfigError(f"hardware file {path}: {bad[0]} is not a finite number; {FORMAT}")
    memory = data["device"]["memory_gib"]
    reserved = data["device"].get("achieved", {}).get("reserved_gib", 0)
    if reserved >= memory:
        raise ConfigError(
            f"hardware file {path}: [device.achieved] reserved_gib = {reserved} leaves nothing "
            f"of [device] memory_gib = {memory}; reserve less than the device's memory"
        )


def _table(data: dict[str, Any], dotted: str, path: Path) -> dict[str, Any]:
    table: Any = data
    for part in dotted.split("."):
        table = table.get(part, {})
        if not isinstance(table, dict):
            raise ConfigError(
                f"hardware file {path}: [{dotted}] must be a table of key = value lines; {FORMAT}"
            )
    return table


def _check_number(path: Path, where: str, value: Any, rule: str) -> None:
    if problem := domains.number_problem(where, value, RULES[rule]):
        raise ConfigError(f"hardware file {path}: {problem}; {FORMAT}")


def system_for_device_name(device_name: str) -> System | None:
    """The built-in system whose device matches torch's device name, if any."""
    for name in list_systems():
        system = load_system(name)
        if any(part in device_name for part in system.device.match):
            return system
    return None


def _parse(data: dict[str, Any], default_name: str) -> System:
    dev, achieved = data["device"], data["device"].get("achieved", {})
    kind = dev.get("kind", default_name)
    peaks = dict(DENSE_PEAK_TFLOPS.get(kind, {}))
    peaks.update({k: float(v) for k, v in dev.get("peak_tflops", {}).items()})
    if not peaks:
        raise ValueError(
            f"device kind {kind!r} is not in the peak table: give [device] peak_tflops"
        )
    device = Device(
        name=str(dev.get("name", kind)),
        kind=kind,
        peak_tflops=tuple(sorted(peaks.items())),
        memory_bytes=float(dev["memory_gib"]) * GIB,
        memory_bandwidth=float(dev["memory_bandwidth_gb_s"]) * GB,
        gemm_efficiency=float(achieved.get("gemm_efficiency", 0.75)),
        memory_efficiency=float(achieved.get("memory_efficiency", 0.85)),
        kernel_overhead=float(achieved.get("kernel_overhead_us", 5)) * 1e-6,
        reserved_bytes=float(achieved["reserved_gib"]) * GIB
        if "reserved_gib" in achieved
        else None,
        match=tuple(dev.get("match", ())),
        gemm_curve=_curve(achieved),
        attention_efficiency=float(achieved.get("attention_efficiency", 0.0)),
        attention_backward_ratio=float(achieved.get("attention_backward_ratio", 0.0)),
        attention_curve=_attention_curve(achieved),
        memory_kernels=_memory_kernels(achieved),
        layer_overhead=_pair(achieved, "layer_overhead_us"),
        head_overhead=_pair(achieved, "head_overhead_us"),
        optimizer_overhead=_pair(achieved, "optimizer_overhead_us", "[per step, per tensor]"),
        split_backward_ratio=float(achieved.get("split_backward_ratio", 1.0)),
        collective_sync=float(achieved.get("collective_sync_us", 0.0)) * 1e-6,
        wait_after_compute=float(achieved.get("wait_after_compute_us", 0.0)) * 1e-6,
        ring_sync=(float(achieved["ring_sync_us"]) * 1e-6 if "ring_sync_us" in achieved else None),
    )
    return System(
        name=str(data.get("name", default_name)),
        description=str(data.get("description", "")),
        device=device,
        gpus_per_node=int(data["node"]["gpus"]),
        intra=_link(data["node"]),
        inter=_link(data["network"]),
        host_memory_bytes=_gib(data["node"].get("host_memory_gib")),
    )


def _gib(value: float | None) -> float | None:
    return None if value is None else float(value) * GIB


def _pair(
    achieved: dict[str, Any], key: str, what: str = "[forward, backward]"
) -> tuple[float, float]:
    """Two microseconds -> seconds (absent: no overhead)."""
    values = [float(v) for v in achieved.get(key, [0.0, 0.0])]
    if len(values) != 2 or min(values) < 0:
        raise ValueError(f"{key} must be {what} microseconds, both >= 0")
    return values[0] * 1e-6, values[1] * 1e-6


def _curve(achieved: dict[str, Any]) -> tuple[tuple[float, float], ...]:
    sizes = [float(x) for x in achieved.get("gemm_curve_flops", [])]
    values = [float(y) for y in achieved.get("gemm_curve_efficiency", [])]
    if len(sizes) != len(values):
        raise ValueError("gemm_curve_flops and gemm_curve_efficiency differ in length")
    increasing = all(a < b for a, b in zip(sizes, sizes[1:]))
    monotone = all(a <= b for a, b in zip(values, values[1:]))
    if not (increasing and monotone and all(0 < y for y in values) and all(0 < x for x in sizes)):
        raise ValueError(
            "the GEMM curve needs positive sizes, increasing, with positive efficiencies that "
            "never decrease (as `ptdp calibrate` writes it)"
        )
    return tuple(zip(sizes, values))


def _attention_curve(achieved: dict[str, Any]) -> tuple[tuple[float, float, float], ...]:
    keys = ("attention_curve_flops", "attention_curve_efficiency")
    keys += ("attention_curve_backward_efficiency",)
    sizes, forward, backward = [[float(v) for v in achieved.get(k, [])] for k in keys]
    if not len(sizes) == len(forward) == len(backward):
        raise ValueError(f"{', '.join(keys)} differ in length")
    increasing = all(a < b for a, b in zip(sizes, sizes[1:]))
    monotone = all(a <= b for ys in (forward, backward) for a, b in zip(ys, ys[1:]))
    if not (increasing and monotone and min(sizes + forward + backward, default=1) > 0):
        raise ValueError(
            "the attention curve needs positive sizes, increasing, with positive efficiencies "
            "that never decrease (as `ptdp calibrate` writes it)"
        )
    return tuple(zip(sizes, forward, backward))


def _memory_kernels(
    achieved: dict[str, Any],
) -> tuple[tuple[str, tuple[tuple[float, float], ...]], ...]:
    """[device.achieved.memory_kernels] kernel = [[bytes, GB/s], ...] -> (kernel, ((bytes,
    bytes/s), ...)), each checked: positive figures, sizes increasing."""
    kernels = []
    for name, pairs in achieved.get("memory_kernels", {}).items():
        curve = tuple((float(b), float(bw) * GB) for b, bw in pairs)
        sizes = [b for b, _ in curve]
        if not curve or min(min(p) for p in curve) <= 0 or sizes != sorted(set(sizes)):
            raise ValueError(
                f"memory_kernels.{name} must be [[bytes, GB/s], ...] pairs, both positive, "
                "bytes increasing (as `ptdp calibrate` writes it)"
            )
        kernels.append((str(name), curve))
    return tuple(kernels)


def _link(table: dict[str, Any]) -> Link:
    ops = []
    for op in ("p2p", *LINK_OPS):
        pair = (f"{op}_latency_us", f"{op}_bandwidth_gb_s")
        given = [k in table for k in pair]
        if any(given) and not all(given):
            raise ValueError(f"{pair[0]} and {pair[1]} go together: give both or neither")
        if all(given) and op != "p2p":
            ops.append((op, float(table[pair[0]]) * 1e-6, float(table[pair[1]]) * GB))
    keys = ("p2p_latency_us", "p2p_bandwidth_gb_s")
    given = [k in table for k in keys]
    return Link(
        name=str(table.get("link", "")),
        bandwidth=float(table["bandwidth_gb_s"]) * GB,
        efficiency=float(table.get("efficiency", 1.0)),
        latency=float(table.get("latency_us", 0.0)) * 1e-6,
        step_latency=float(table.get("step_latency_us", 0.0)) * 1e-6,
        p2p=(float(table[keys[0]]) * 1e-6, float(table[keys[1]]) * GB) if all(given) else None,
        ops=tuple(ops),
    )
