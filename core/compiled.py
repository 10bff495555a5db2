"""Lookups compiled once per process: the request's user, a session by id, a session's state.

Django compiles a queryset's SQL every time it runs it. For a one-row read with joins and subqueries
that is most of the read's cost (the request's user, with its account, home use and limits: 3 ms of a
4.7 ms read on the machines ``make load`` runs on), and such reads run on every request. A ``Lookup``
compiles its query once, with stand-in keys, and then runs the same SQL with the real ones, making the
row into instances as Django's own iterator does (``select_related`` objects attached, annotations set,
field converters applied). The queryset is still written with the ORM, so the SQL follows the models.
"""

from __future__ import annotations

import datetime
import threading
import uuid
import zoneinfo
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from django.db import connections
from django.db.models import Field, ForeignObject, QuerySet
from django.db.models import Lookup as DjangoLookup
from django.db.models.query import (
    FlatValuesListIterable,
    ModelIterable,
    ValuesListIterable,
    get_related_populators,
)
from django.utils import timezone

# Stand-ins no real key takes, one per key of a lookup, found again in the compiled parameters.
_STAND_INS = {
    int: (-7_340_033_101, -7_340_033_102),
    uuid.UUID: (uuid.UUID(int=0x5_7A_11D_1), uuid.UUID(int=0x5_7A_11D_2)),
    str: ("\x00core.compiled key 1\x00", "\x00core.compiled key 2\x00"),  # PostgreSQL text holds no NUL
    datetime.datetime: (
        datetime.datetime(1001, 2, 3, 4, 5, 6, 7, tzinfo=datetime.UTC),
        datetime.datetime(1002, 3, 4, 5, 6, 7, 8, tzinfo=datetime.UTC),
    ),
    list: (["\x00core.compiled list 1\x00"], ["\x00core.compiled list 2\x00"]),  # for ``__any``
}


class AnyOf(DjangoLookup):
    """``field__any=[…]``: ``field = ANY(%s)``, the values one array parameter, where ``__in`` writes a
    placeholder for each. Its SQL is the same however many values, so a compiled ``Lookup`` may take a
    list as a key (the ids of a page's sessions). The values go to the database as they are: give
    values of the field's type."""

    lookup_name = "any"
    prepare_rhs = False

    def get_prep_lookup(self):
        if isinstance(self.rhs, str | bytes) or not isinstance(self.rhs, Iterable):
            raise TypeError(f"field__any= takes a list of values, not {type(self.rhs).__name__}")
        return list(self.rhs)

    def as_sql(self, compiler, connection):
        lhs, lhs_params = self.process_lhs(compiler, connection)
        return f"{lhs} = ANY(%s)", (*lhs_params, self.rhs)


Field.register_lookup(AnyOf)
ForeignObject.register_lookup(AnyOf)  # a foreign key's lookups are its own, not Field's: its id column


class _NoSuchKey(Exception):
    pass


def _key(value, kind: type):
    """``value`` as a key of type ``kind``: itself, or a string that reads as one (an id from a URL, a
    session, a task's arguments: ``"42"`` for an int, a UUID's text); anything else (None, a bool, a
    malformed id) raises ``_NoSuchKey``."""
    if kind is list and isinstance(value, list | tuple | set | frozenset):
        return list(value)
    if type(value) is kind:
        if kind is datetime.datetime and value.utcoffset() is None:
            raise ValueError("a datetime key of a Lookup must be aware: the ORM would have made it so")
        return value
    if isinstance(value, str):
        if kind is int and value.isascii() and value.isdigit():
            return int(value)
        if kind is uuid.UUID:
            try:
                return uuid.UUID(value)
            except ValueError:
                pass
    raise _NoSuchKey


_SHAPES = {ModelIterable: "model", ValuesListIterable: "tuple", FlatValuesListIterable: "flat"}


@dataclass(frozen=True)
class _Compiled:
    db: str
    sql: str
    params: tuple
    key_positions: tuple[tuple[int, ...], ...]  # for each key, where it is in the parameters
    compiler: object  # the SQLCompiler, read-only after as_sql(): select, klass_info, converters
    shape: str  # "model": instances; "tuple": values_list() rows; "flat": values_list(flat=True) values
    init_list: tuple[str, ...] = ()
    model_slice: slice | None = None
    related_populators: tuple = ()
    annotation_col_map: dict | None = None


class Lookup:
    """``build(*keys)`` gives a queryset filtered by ``keys`` (each an ``int``, a ``uuid.UUID``, a
    ``str``, an aware ``datetime`` or a ``list`` for a ``field__any=`` filter, of the types given as
    ``key_types``; a key may be used more than once). ``first(*keys)`` runs it as ``.first()`` would (at
    most one row is read), ``all(*keys)`` (``many=True``: the queryset orders and slices itself) as
    ``list()`` would, without compiling it again. What it reads: model instances (what the queryset
    selects: no ``prefetch_related``, no ``defer``), or the rows of ``values_list()`` (tuples, or
    values with ``flat=True``); not ``values()``. A key may also be a string that reads as its type (an
    id from a URL or a session); a key that is neither (None, a malformed id) matches no row, so
    callers turn bad input into "not found" without guarding it themselves."""

    def __init__(
        self, build: Callable[..., QuerySet], *, key_types: tuple[type, ...], many: bool = False
    ) -> None:
        for kind in set(key_types):
            if key_types.count(kind) > len(_STAND_INS[kind]):
                raise ValueError(
                    f"a Lookup takes at most {len(_STAND_INS[kind])} keys of type {kind.__name__}"
                )
        self._build = build
        self._key_types = key_types
        self._many = many
        self._compiled: _Compiled | None = None
        self._lock = threading.Lock()

    def _compile(self) -> _Compiled:
        # A query whose SQL names the request's time zone (a ``__date`` lookup, a ``Trunc``) would keep
        # the first request's zone for everyone: compiled in two zones, its SQL must be the same.
        with timezone.override(datetime.UTC):
            compiled = self._compile_here()
        with timezone.override(zoneinfo.ZoneInfo("Pacific/Chatham")):
            elsewhere = self._compile_here()
        if (compiled.sql, compiled.params) != (elsewhere.sql, elsewhere.params):
            raise ValueError(f"a Lookup's query must not depend on the time zone ({compiled.sql})")
        return compiled

    def _compile_here(self) -> _Compiled:
        # the first key of a type stands in as its first stand-in, the second as its second
        stand_ins = [
            _STAND_INS[kind][self._key_types[:n].count(kind)] for n, kind in enumerate(self._key_types)
        ]
        queryset = self._build(*stand_ins)
        if not self._many:
            queryset = queryset[:1]
        if queryset._prefetch_related_lookups or queryset.query.deferred_loading[0]:
            raise ValueError("a Lookup reads what its queryset selects: no prefetch_related, no defer")
        shape = _SHAPES.get(queryset._iterable_class)
        if shape is None:
            raise ValueError("a Lookup reads model instances or values_list() rows: no values()")
        compiler = queryset.query.get_compiler(using=queryset.db)
        sql, params = compiler.as_sql()
        positions = []
        for stand_in in stand_ins:
            found = tuple(n for n, value in enumerate(params) if value == stand_in)
            if not found:
                raise ValueError(f"a key of a Lookup must appear in its query's parameters ({sql})")
            positions.append(found)
        common = {
            "db": queryset.db,
            "sql": sql,
            "params": tuple(params),
            "key_positions": tuple(positions),
            "compiler": compiler,
            "shape": shape,
        }
        if shape != "model":
            return _Compiled(**common)
        klass_info = compiler.klass_info
        fields = klass_info["select_fields"]
        start, end = fields[0], fields[-1] + 1
        return _Compiled(
            **common,
            init_list=tuple(column[0].target.attname for column in compiler.select[start:end]),
            model_slice=slice(start, end),
            related_populators=tuple(get_related_populators(klass_info, compiler.select, queryset.db)),
            annotation_col_map=dict(compiler.annotation_col_map or {}),
        )

    def first(self, *keys):
        if self._many:
            raise TypeError("first() is for a Lookup of one row; this one is many=True: all()")
        found = self._run(keys)
        return found[0] if found else None

    def all(self, *keys) -> list:
        if not self._many:
            raise TypeError("all() is for a Lookup made with many=True")
        return self._run(keys)

    def _run(self, keys: tuple) -> list:
        try:
            keys = tuple(_key(key, kind) for key, kind in zip(keys, self._key_types, strict=True))
        except _NoSuchKey:
            return []  # what no row has: a missing key, or input that is not one (a malformed id)
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = self._compile()
        c = self._compiled
        params = list(c.params)
        for positions, key in zip(c.key_positions, keys, strict=True):
            for position in positions:
                params[position] = key
        with connections[c.db].cursor() as cursor:
            cursor.execute(c.sql, params)
            rows = cursor.fetchall()
        if c.shape == "tuple":
            return list(c.compiler.results_iter([rows], tuple_expected=True))
        if c.shape == "flat":
            return [row[0] for row in c.compiler.results_iter([rows])]
        found = []
        for row in c.compiler.results_iter([rows]):
            obj = c.compiler.query.model.from_db(c.db, list(c.init_list), row[c.model_slice])
            for populator in c.related_populators:
                populator.populate(row, obj)
            for name, position in c.annotation_col_map.items():
                setattr(obj, name, row[position])
            found.append(obj)
        return found
