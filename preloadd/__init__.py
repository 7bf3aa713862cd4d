"""preloadd"""
