"""The trial history shown: the terminal table and the self-contained HTML report."""
