"""What goes wrong in a long run and how the run reacts: non-finite losses and stop signals
(numerical.py), and ranks that die, hang or lag (watchdog.py: its thread and decisions;
heartbeats.py: its records in the launcher's store; failures.py: errors told apart and
failures described; straggler.py: slow steps); events.jsonl records (events.py)."""
