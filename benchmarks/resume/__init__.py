"""What resuming a session costs: bounded replay vs exact replay vs re-prefill, through a daemon."""
