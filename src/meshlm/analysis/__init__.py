"""HLO/StableHLO analysis of the real train step: census, detectors, A/B diff, attribution.

Modules: `census` (the counts and detectors; `census.census(cfg)` is the entry point), `compare`
(side-by-side counts and the signature-bucketed diff), `hlo` and `stablehlo` (text readers),
`scopes` (named-scope attribution), `arms` (--arm parsing), `golden` (the pinned counts).
"""
