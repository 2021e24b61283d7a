"""What goes wrong in a long run and how the run reacts: non-finite losses and stop signals
(numerical.py), and ranks that die, hang or lag (watchdog.py)."""
