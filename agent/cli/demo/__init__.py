"""`kvpilot demo`: the run (`run.py`), its scripted scenario, the webhook receiver, and the
live view with the state it shows."""
