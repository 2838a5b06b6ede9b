"""The study: sweep files, their runner and report, the pre-registered analysis, and the claims table."""
