"""What a run says: the typed configuration and everything that reads or writes it.

sections.py   the frozen dataclasses, one per section (ModelConfig ... CheckpointConfig),
              under RunConfig; every field typed, defaulted and documented
enums.py      the enumerated choices of their fields (Schedule, Precision, ...)
files.py      TOML files and `--section.key value` overrides applied on the defaults, the
              resolved config written back as TOML, the `--help` text
presets.py    `--model NAME`: published models' shapes as config updates
reference.py  docs/configuration.md, generated from the dataclasses' docstrings

What a run may say (the cross-field rules and the domains of numbers) is `ptdp.rules`. No
module here imports it, but reference.py, which shows each number's domain on the page.
"""
