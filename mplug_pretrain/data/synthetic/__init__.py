"""Procedural demo data: scenes of coloured shapes with captions, statements, referring expressions, videos."""
