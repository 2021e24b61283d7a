"""`python -m ptdp ...`, the form `torchrun -m ptdp ...` uses."""

from ptdp.cli import main

raise SystemExit(main())
