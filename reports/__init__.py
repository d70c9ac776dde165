"""Reports made from recorded results: JUnit and Allure (written by pytest) and the certification summary."""
