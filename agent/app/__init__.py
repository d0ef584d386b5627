"""The process: one composition root from config to parts, its lifecycle, the HTTP app and API."""
