"""Simulated hardware, zones and prices for energy-, carbon- and cost-aware placement (issue #15).

A fleet is given as `PROFILE@ZONE[:spot]` items, one per learner, e.g. `h100@hydro,a100@solar:spot,v100@coal`.
A learner's relative speed (1 = one inner step per `step_time_s`) and its power come from its profile; its carbon
intensity from its zone in the trace (`diloco.core.energy.CarbonTrace`); its price per hour from the profile's
on-demand or spot price.

The profiles are *approximate* and stated for illustration; they are modelled on data-centre parts:

| profile | part | power (W) | relative training throughput | on-demand / spot ($/h) |
|---|---|---|---|---|
| `h100` | NVIDIA H100 SXM5 | 700 (vendor TDP) | 1.0 (989 dense bf16 TFLOPS) | 4.00 / 2.00 |
| `a100` | NVIDIA A100 SXM4 | 400 (vendor TDP) | 0.4 (312 dense bf16 TFLOPS; ~2.5x below H100) | 2.00 / 0.90 |
| `v100` | NVIDIA V100 SXM2 | 300 (vendor TDP) | 0.16 (125 fp16 tensor TFLOPS, no bf16; ~2.5x below) | 1.50 / 0.60 |
| `p100` | NVIDIA P100 SXM2 | 300 (vendor TDP) | 0.055 (21 fp16 TFLOPS, no tensor cores; ~3x below V100) | 1.00 / 0.40 |

Power is the vendor's TDP (board power), drawn while training; relative throughputs are the vendors' peak
tensor-core figures scaled to what mixed-precision transformer training typically reaches (MLPerf-style
generation-to-generation ratios), rounded. Prices are round figures of the order of public-cloud GPU list prices
per GPU-hour (spot at roughly 40-50% of on-demand), not quotes. Idle draw is not modelled: a learner draws its power
while it trains (the simulator's busy time) and nothing otherwise, so a paused learner is taken as powered down
and released (it costs nothing either).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.errors import ConfigError


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    speed: float  # relative to h100 = 1.0
    watts: float  # while training
    price_per_hour: float  # on demand
    spot_price_per_hour: float


PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("h100", 1.0, 700.0, 4.00, 2.00),
        HardwareProfile("a100", 0.4, 400.0, 2.00, 0.90),
        HardwareProfile("v100", 0.16, 300.0, 1.50, 0.60),
        HardwareProfile("p100", 0.055, 300.0, 1.00, 0.40),
    )
}


@dataclass(frozen=True)
class FleetLearner:
    profile: str
    zone: str
    spot: bool = False

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ConfigError(f"fleet: unknown hardware profile {self.profile!r}; allowed: {', '.join(PROFILES)}")
        if not self.zone:
            raise ConfigError(f"fleet: learner {self.profile} needs a zone (PROFILE@ZONE)")

    @property
    def hw(self) -> HardwareProfile:
        return PROFILES[self.profile]

    @property
    def price_per_hour(self) -> float:
        return self.hw.spot_price_per_hour if self.spot else self.hw.price_per_hour


def parse_fleet(text: str) -> tuple[FleetLearner, ...]:
    """`"h100@hydro,a100@solar:spot"` -> one `FleetLearner` per item."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        body, _, flag = item.partition(":")
        profile, at, zone = body.partition("@")
        if not at or flag not in ("", "spot", "on-demand"):
            raise ConfigError(f"fleet: expected items like h100@hydro or a100@solar:spot, got {item!r}")
        out.append(FleetLearner(profile.strip(), zone.strip(), flag == "spot"))
    return tuple(out)
