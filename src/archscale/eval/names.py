"""Full-name generators for the Phonebook task.

* `full_name(rng)`: our offline lists (common English-language first and last names, drawn uniformly).
* `names_package_full_name(rng)`: ArchScale's generator, the PyPI package `names` (0.3.0, the US Census 1990 name
  frequency lists it ships), reimplemented to draw from a given `random.Random` instead of the global one: the
  same calls in the same order as `names.get_full_name()` (gender = choice(("male", "female")); a first name, then
  a last name, each the first line of its list whose cumulative frequency exceeds random() * 90), so a book built
  from `random.Random(s)` is the book ArchScale's `eval_phonebook.py` builds after `random.seed(s)`. It reads the
  package's own data files: `pip install names` (in archscale's `eval` extra).
"""

from __future__ import annotations

import bisect
import random
from functools import lru_cache
from pathlib import Path

from archscale.errors import UserError

FIRST_NAMES = """
James Mary Robert Patricia John Jennifer Michael Linda David Elizabeth William Barbara Richard Susan Joseph Jessica
Thomas Sarah Charles Karen Christopher Lisa Daniel Nancy Matthew Betty Anthony Margaret Mark Sandra Donald Ashley
Steven Kimberly Paul Emily Andrew Donna Joshua Michelle Kenneth Carol Kevin Amanda Brian Dorothy George Melissa
Timothy Deborah Ronald Stephanie Edward Rebecca Jason Sharon Jeffrey Laura Ryan Cynthia Jacob Kathleen Gary Amy
Nicholas Angela Eric Shirley Jonathan Anna Stephen Brenda Larry Pamela Justin Emma Scott Nicole Brandon Helen
Benjamin Samantha Samuel Katherine Gregory Christine Alexander Debra Frank Rachel Patrick Carolyn Raymond Janet
Jack Catherine Dennis Maria Jerry Heather Tyler Diane Aaron Ruth Jose Julie Adam Olivia Nathan Joyce Henry
Virginia Douglas Victoria Zachary Kelly Peter Lauren Kyle Christina Ethan Joan Walter Evelyn Noah Judith Jeremy
Megan Christian Andrea Keith Cheryl Roger Hannah Terry Jacqueline Gerald Martha Harold Gloria Sean Teresa Austin
Ann Carl Sara Arthur Madison Lawrence Frances Dylan Kathryn Jesse Janice Jordan Jean Bryan Abigail Billy Alice
""".split()

LAST_NAMES = """
Smith Johnson Williams Brown Jones Garcia Miller Davis Rodriguez Martinez Hernandez Lopez Gonzalez Wilson Anderson
Thomas Taylor Moore Jackson Martin Lee Perez Thompson White Harris Sanchez Clark Ramirez Lewis Robinson Walker
Young Allen King Wright Scott Torres Nguyen Hill Flores Green Adams Nelson Baker Hall Rivera Campbell Mitchell
Carter Roberts Gomez Phillips Evans Turner Diaz Parker Cruz Edwards Collins Reyes Stewart Morris Morales Murphy
Cook Rogers Gutierrez Ortiz Morgan Cooper Peterson Bailey Reed Kelly Howard Ramos Kim Cox Ward Richardson Watson
Brooks Chavez Wood James Bennett Gray Mendoza Ruiz Hughes Price Alvarez Castillo Sanders Patel Myers Long Ross
Foster Jimenez Powell Jenkins Perry Russell Sullivan Bell Coleman Butler Henderson Barnes Gonzales Fisher Vasquez
Simmons Romero Jordan Patterson Alexander Hamilton Graham Reynolds Griffin Wallace Moreno West Cole Hayes Bryant
Herrera Gibson Ellis Tran Medina Aguilar Stevens Murray Ford Castro Marshall Owens Harrison Fernandez McDonald
Woods Washington Kennedy Wells Vargas Henry Chen Freeman Webb Tucker Guzman Burns Crawford Olson Simpson Porter
""".split()


def full_name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def capacity() -> int:
    """How many distinct full names the lists can make."""
    return len(set(FIRST_NAMES)) * len(set(LAST_NAMES))


@lru_cache(maxsize=1)
def _names_package_lists() -> dict[str, tuple[list[str], list[float]]]:
    try:
        import names
    except ImportError:
        raise UserError("ArchScale's Phonebook names come from the `names` package: pip install names (or "
                        "'archscale[eval]')") from None
    folder = Path(names.__file__).parent
    out = {}
    for key, fname in (("male", "dist.male.first"), ("female", "dist.female.first"), ("last", "dist.all.last")):
        words, cumulative = [], []
        for line in (folder / fname).read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                words.append(parts[0])
                cumulative.append(float(parts[2]))
        out[key] = (words, cumulative)
    return out


def _pick(table: tuple[list[str], list[float]], selected: float) -> str:
    words, cumulative = table
    i = bisect.bisect_right(cumulative, selected)  # the first line whose cumulative frequency > selected
    return words[i] if i < len(words) else ""


def names_package_full_name(rng: random.Random) -> str:
    lists = _names_package_lists()
    gender = rng.choice(("male", "female"))
    first = _pick(lists[gender], rng.random() * 90).capitalize()
    return f"{first} {_pick(lists['last'], rng.random() * 90).capitalize()}"


def names_package_available() -> bool:
    try:
        _names_package_lists()
    except UserError:
        return False
    return True
