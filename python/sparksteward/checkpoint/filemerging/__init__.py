"""FLIP-306 file merging: small checkpoint files packed into shared merged files, and the space they
use and waste."""
