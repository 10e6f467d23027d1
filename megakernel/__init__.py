"""megakernel package."""
