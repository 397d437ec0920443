"""Tokenized datasets: `python -m data.prepare` writes them, `data.loader` reads them."""
