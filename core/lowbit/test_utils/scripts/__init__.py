"""lowbit's own check scripts, at Accelerate's ``accelerate.test_utils.scripts`` path: each
``main()`` checks a part of the public API in whatever processes run it (one, ``debug_launcher``,
or ``lowbit launch``) and raises on the first thing that is wrong."""
