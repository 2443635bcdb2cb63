"""The clients: loads into caller memory and devices, restarts, replay sessions."""
