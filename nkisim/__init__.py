"""nkisim package."""
