"""What the package installs and imports."""
