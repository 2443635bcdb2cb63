"""How close a resumed session is to one never evicted; the A/B of the in-window rule."""
