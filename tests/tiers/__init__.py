"""Each storage tier alone, and the Tier contract every tier keeps."""
