"""The top layer: what each command composes from the layers below (model=PATH resolution, convert,
generate, census/compare, bench). Nothing below imports it; cli.py dispatches to it."""
