"""`python -m meshws.bench` keeps working: the benchmark lives in `meshws.tools.bench`."""

from .tools.bench import main

if __name__ == "__main__":
    main()
